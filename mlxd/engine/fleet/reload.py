"""A reloaded registry, applied to a running fleet.

Removed models finish what they run, then unload; added ones start
unloaded (pinned ones load); changed ones take their new settings between
two steps, or load again when their path or kind changed. A mixin of
:class:`mlxd.engine.fleet.fleet.Fleet`, kept apart so the fleet reads as routing,
loading and memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from mlxd.config import Settings
from mlxd.config.entry import ModelEntry
from mlxd.config.registry import for_model, registry
from mlxd.engine.fleet.slot import Slot, budget_bytes, estimate_weights, swallow_failure

if TYPE_CHECKING:
    from mlxd.engine.fleet.memory import MemoryPool

# Keys of an entry whose change needs the model loaded again.
_SWAP_KEYS = ("path", "chat_template", "tool_parser", "max_context", "demo_dtype", "kind")


class RegistryReload:
    """``Fleet.apply`` and its steps; the fleet provides the rest."""

    settings: Settings
    slots: dict[str, Slot]
    pool: MemoryPool
    _device_bytes: int
    _make_engine: Any

    async def apply(self, settings: Settings) -> dict[str, str]:
        """Adopt a reloaded registry; returns the models whose swap failed, with why.

        Removed models finish what they run, then unload; added ones start
        unloaded (pinned ones load); changed ones get their new settings
        live, or are loaded again when their path or kind changed.
        """
        old = self.settings
        self.settings = settings
        self.pool.set_budget(budget_bytes(settings, self._device_bytes))
        new = registry(settings)
        renamed = None
        if not old.models and not settings.models:  # one [model] table: its id may change
            (old_id,), (new_id,) = registry(old), new
            if old_id != new_id and old_id in self.slots:
                renamed = (old_id, new_id)
                self._rename(old_id, new_id)
        errors: dict[str, str] = {}
        for model_id, slot in list(self.slots.items()):
            if model_id not in new:
                slot.removed = True
                task = asyncio.ensure_future(self._remove(slot))
                task.add_done_callback(swallow_failure)
        for model_id, entry in new.items():
            slot = self.slots.get(model_id)
            if slot is None or slot.removed:
                if slot is not None:  # removed and added back before it left: wait for it
                    await asyncio.shield(self._removal(slot))
                added = self._add(model_id, settings)
                if added.engine is not None:
                    added.engine.start()
                self._event(model_id, "added", "by a reload")
                if added.pinned:
                    self._spawn_load(added)
                continue
            error = await self._change(slot, entry, settings, old)
            if error:
                errors[model_id] = error
        if renamed and errors:
            self._rename(renamed[1], renamed[0])
        self._notify()
        return errors

    def _rename(self, old_id: str, new_id: str) -> None:
        """The one ``[model]`` table's id changed (its path or name): same slot, new id."""
        slot = self.slots.pop(old_id)
        slot.id = new_id
        self.slots[new_id] = slot
        self.pool.rename(old_id, new_id)
        if slot.engine is not None:
            slot.engine.rename(new_id)

    async def _change(
        self, slot: Slot, entry: ModelEntry, settings: Settings, old: Settings
    ) -> str | None:
        before, before_settings = slot.entry, slot.settings
        slot.entry, slot.settings = entry, for_model(settings, slot.id)
        swap = any(getattr(before, k) != getattr(entry, k) for k in _SWAP_KEYS)
        if before.kind != entry.kind:
            # A different kind is a different engine: unload, then start over.
            if slot.state == "loaded":
                await asyncio.shield(self._unloading(slot, "unloaded", "its kind changed"))
            if slot.engine is not None:
                await asyncio.to_thread(slot.engine.stop)
            slot.engine = None
            if entry.kind == "chat":
                slot.engine = self._make_engine(slot.settings, slot.id, self.pool, False)
                slot.engine.start()
        elif entry.kind == "chat":
            engine = slot.engine
            if swap and slot.state == "loaded":
                try:
                    info = await asyncio.wrap_future(engine.load(slot.settings))
                except Exception as exc:
                    slot.entry, slot.settings = before, before_settings
                    return f"model swap failed, the previous model keeps serving: {exc}"
                self.pool.settle(slot.id, info.weights_bytes + slot.prompt_cache_cap())
                self._event(slot.id, "loaded", "swapped by a reload")
            await asyncio.wrap_future(engine.apply(slot.settings))
        elif swap and slot.state == "loaded":
            await asyncio.shield(self._unloading(slot, "unloaded", "its path changed"))
            self._spawn_load(slot)
        elif slot.engine is not None:  # an embedding model: its batch size, live
            slot.engine.apply(slot.settings)
        if slot.pinned and slot.state in ("unloaded", "failed"):
            self._spawn_load(slot)
        return None

    def _add(self, model_id: str, settings: Settings) -> Slot:
        entry = registry(settings)[model_id]
        slot = Slot(model_id, entry, for_model(settings, model_id))
        if entry.kind == "chat":
            # Before run(), a pinned model loads on its engine thread (a cluster's
            # one model always: every rank loads its shard at start).
            pinned = entry.pin or settings.cluster is not None
            at_start = pinned and self._changed is None
            if at_start:
                self.pool.settle(model_id, estimate_weights(entry) + slot.prompt_cache_cap())
                slot.state = "loading"
            slot.engine = self._make_engine(slot.settings, model_id, self.pool, at_start)
        self.slots[model_id] = slot
        return slot

    def _removal(self, slot: Slot) -> asyncio.Future:
        return slot.task if slot.task is not None else asyncio.sleep(0)

    async def _remove(self, slot: Slot) -> None:
        if slot.task is not None and not slot.task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(slot.task)
        if slot.state == "loaded":
            await asyncio.shield(self._unloading(slot, "removed", "by a reload"))
        engine, slot.engine = slot.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.stop)
        if self.slots.get(slot.id) is slot:
            del self.slots[slot.id]
        self._notify()
