"""A reloaded registry, applied to a running fleet.

Removed models finish what they run, then unload and their engines stop;
added ones start unloaded (pinned ones load); changed ones take their new
settings between two steps (:meth:`ModelEngine.apply`), or load their new
model in place when their path changed (a failed swap keeps the old one),
or get a new engine when their kind changed. Every engine is driven through
:class:`~mlxd.engine.model_engine.ModelEngine`, whatever its kind.
"""

from __future__ import annotations

import asyncio
import contextlib

from mlxd.config import Settings, format_bytes
from mlxd.config.entry import ModelEntry
from mlxd.config.registry import for_model, registry
from mlxd.engine.fleet.fit import Fit, over_budget
from mlxd.engine.fleet.loading import Loads
from mlxd.engine.fleet.slot import Slot, budget_bytes, swallow_failure
from mlxd.engine.fleet.slots import Slots
from mlxd.engine.fleet.unloading import Unloads
from mlxd.engine.fleet.values import FleetApplied

# Keys of an entry whose change needs the model loaded again.
_SWAP_KEYS = (
    "path", "repo", "revision", "chat_template", "tool_parser", "max_context", "demo_dtype", "kind"
)  # fmt: skip


def _draft(settings: Settings) -> str | None:
    spec = settings.speculative
    if spec.mode == "mtp":  # the MTP head loads with its target too
        return "mtp"
    return spec.draft_model if spec.mode == "draft" else None


class RegistryReload:
    """``Fleet.apply`` and its steps."""

    def __init__(self, slots: Slots, loads: Loads, unloads: Unloads, fit: Fit, device_bytes: int):
        self._slots = slots
        self._fit = fit
        self._loads = loads
        self._unloads = unloads
        self._device_bytes = device_bytes

    async def apply(self, settings: Settings) -> FleetApplied:
        """Adopt a reloaded registry; returns the swaps that failed and the changes kept back.

        Removed models finish what they run, then unload; added ones start
        unloaded (pinned ones load); changed ones get their new settings
        live, or are loaded again when their path or kind changed. A loaded
        model's prompt-cache cap moves its reservation in the memory budget:
        at once when it shrinks, when the budget has room when it grows (else
        the model keeps its cap, and ``kept`` says so). A budget lowered below
        what the loaded models reserve unloads idle unpinned ones until the
        rest fit (``evicted``); what still does not fit is ``over_budget``.
        """
        slots = self._slots
        old = slots.settings
        slots.settings = settings
        slots.pool.set_budget(budget_bytes(settings, self._device_bytes))
        new = registry(settings)
        renamed = None
        if not old.models and not settings.models:  # one [model] table: its id may change
            (old_id,), (new_id,) = registry(old), new
            if old_id != new_id and old_id in slots.by_id:
                renamed = (old_id, new_id)
                self._rename(old_id, new_id)
        errors: dict[str, str] = {}
        kept: dict[str, str] = {}
        for model_id, slot in list(slots.by_id.items()):
            if model_id not in new:
                slot.removed = True
                task = asyncio.ensure_future(self._remove(slot))
                task.add_done_callback(swallow_failure)
        slots.notify()  # requests waiting for a removed model's load are refused now
        for model_id, entry in new.items():
            slot = slots.by_id.get(model_id)
            if slot is None or slot.removed:
                if slot is not None:  # removed and added back before it left: wait for it
                    await _settled(slot)
                added = slots.add(model_id, settings)
                added.engine.start()
                slots.event(model_id, "added", "by a reload")
                if added.pinned:
                    self._loads.spawn(added)
                continue
            error = await self._change(slot, entry, settings, kept)
            if error:
                errors[model_id] = error
        if renamed and errors:
            self._rename(renamed[1], renamed[0])
        evicted = await self._fit.now("to fit [memory] budget after a reload")
        slots.notify()
        return FleetApplied(errors, kept, tuple(evicted), over_budget(slots))

    def _rename(self, old_id: str, new_id: str) -> None:
        """The one ``[model]`` table's id changed (its path or name): same slot, new id."""
        slots = self._slots
        slot = slots.by_id.pop(old_id)
        slot.id = new_id
        slots.by_id[new_id] = slot
        slots.pool.rename(old_id, new_id)
        slot.engine.rename(new_id)

    async def _change(
        self, slot: Slot, entry: ModelEntry, settings: Settings, kept: dict[str, str]
    ) -> str | None:
        before, before_settings = slot.entry, slot.settings
        slot.entry, slot.settings = entry, for_model(settings, slot.id)
        if before.kind != entry.kind:
            # A different kind is a different engine: unload, then start over.
            if slot.state == "loaded":
                await asyncio.shield(self._unloads.start(slot, "unloaded", "its kind changed"))
            old = slot.engine
            slot.engine = self._slots.make_engine(slot.settings, slot.id, entry.kind)
            slot.engine.start()
            await asyncio.to_thread(old.stop)
        else:
            swap = any(getattr(before, k) != getattr(entry, k) for k in _SWAP_KEYS)
            # A draft model or MTP head loads with its target (docs/configuration.md#speculative).
            swap = swap or _draft(before_settings) != _draft(slot.settings)
            if swap and slot.state == "loaded":
                try:
                    info = await asyncio.wrap_future(slot.engine.load(slot.settings))
                except Exception as exc:
                    slot.entry, slot.settings = before, before_settings
                    return f"model swap failed, the previous model keeps serving: {exc}"
                self._slots.pool.settle(slot.id, info.weights_bytes + slot.prompt_cache_cap())
                self._slots.event(slot.id, "loaded", "swapped by a reload")
            elif slot.state == "loaded":
                note = self._resize_cache(slot, before_settings.prompt_cache.max_bytes)
                if note:
                    kept[slot.id] = note
            await asyncio.wrap_future(slot.engine.apply(slot.settings))
        if slot.pinned and slot.state in ("unloaded", "failed"):
            self._loads.spawn(slot)
        return None

    def _resize_cache(self, slot: Slot, held: int) -> str | None:
        """Move a loaded model's reservation to its new prompt-cache cap (``held`` before).

        A smaller cap frees its bytes at once; a larger one is reserved when
        the budget has room, else the model keeps ``held`` (its settings are
        cut back to it) and the answer says why.
        """
        want = slot.prompt_cache_cap()
        info = slot.engine.info
        if want == held or info is None or slot.entry.kind != "chat":
            return None
        pool = self._slots.pool
        weights = info.weights_bytes
        if want < held:
            pool.settle(slot.id, weights + want)
            return None
        if pool.reserve(slot.id, weights + want):
            return None
        cache = slot.settings.prompt_cache.model_copy(update={"max_bytes": held})
        slot.settings = slot.settings.model_copy(update={"prompt_cache": cache})
        usage = pool.usage()
        return (
            f"the prompt cache of {slot.id} stays at {format_bytes(held)}: "
            f"{format_bytes(want)} does not fit in [memory] budget ({format_bytes(usage.budget)}, "
            f"{format_bytes(usage.free)} free); it grows on a later reload once there is room"
        )

    async def _remove(self, slot: Slot) -> None:
        slots = self._slots
        if slot.task is not None and not slot.task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(slot.task)
        if slot.state == "loaded":
            await asyncio.shield(self._unloads.start(slot, "removed", "by a reload"))
        await asyncio.to_thread(slot.engine.stop)
        if slots.by_id.get(slot.id) is slot:
            del slots.by_id[slot.id]
        slots.notify()


async def _settled(slot: Slot) -> None:
    """Until ``slot``'s load or unload under way ended (its outcome is its own)."""
    if slot.task is not None:
        with contextlib.suppress(Exception):
            await asyncio.shield(slot.task)
    else:
        await asyncio.sleep(0)
