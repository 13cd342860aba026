"""Keeping the loaded models inside ``[memory] budget`` when it shrinks or runs short.

A reload may lower the budget below what the loaded models reserve (weights
plus prompt-cache caps): every model's KV room is then 0 and no request
could be admitted. The fleet does not let that stand:

- **over-committed** (the reservations fill the budget): idle, unpinned
  models are unloaded, least recently used first, until the rest fit, at
  the reload and again at every tick (a busy model goes once its requests
  end). What cannot be evicted (pinned or busy models) is said in one
  sentence: the reload's warning, ``/ready``'s reason, the dashboard's banner;
- **short for one request** (a request's KV does not fit what the other
  models' reservations leave): idle, unpinned other models are unloaded one
  at a time and the request is tried again, so a request is refused only for
  what no eviction can free (its own ``kv_budget``, pinned or busy models).
"""

from __future__ import annotations

import asyncio

from mlxd.config import format_bytes
from mlxd.config.registry import default_id
from mlxd.engine.fleet.slot import Slot, estimate_weights
from mlxd.engine.fleet.slots import Slots
from mlxd.engine.fleet.unloading import Unloads


def idle_victim(slots: Slots, skip: set[str] | frozenset[str] = frozenset()) -> Slot | None:
    """The least recently used loaded model that nobody uses and nobody pinned (not in ``skip``)."""
    idle = [
        s
        for s in slots.by_id.values()
        if s.id not in skip and s.state == "loaded" and not s.pinned and not s.busy
    ]
    return min(idle, key=lambda s: s.last_used or 0.0, default=None)


def over_budget(slots: Slots) -> str | None:
    """Why no model can admit a request, when the reservations fill the budget; else None.

    Also when ``[memory] budget`` can never hold the default chat model (not
    loaded): every request naming no model would get 400 ``model_too_large``.
    """
    usage = slots.pool.usage()
    fixed = {e.model_id: e.fixed for e in usage.entries}
    reserved = sum(fixed.values())
    if reserved < usage.budget or not fixed:
        return default_never_fits(slots)
    holders = []
    for model_id, nbytes in sorted(fixed.items(), key=lambda kv: -kv[1]):
        slot = slots.by_id.get(model_id)
        why = ""
        if slot is not None:
            why = (
                "pinned"
                if slot.pinned
                else "busy"
                if slot.busy
                else slot.state
                if slot.state != "loaded"
                else "idle"
            )
        holders.append(f"{model_id} {format_bytes(nbytes)}{f' ({why})' if why else ''}")
    return (
        f"[memory] budget ({format_bytes(usage.budget)}) is over-committed: the loaded models "
        f"reserve {format_bytes(reserved)} for weights and prompt caches ({', '.join(holders)}), "
        "which leaves no KV cache for any request. Idle unpinned models are unloaded to fit; "
        "raise [memory] budget, or unpin or unload a model."
    )


def default_never_fits(slots: Slots) -> str | None:
    """Why the default chat model can never load in the budget (as ``Room.make`` refuses it)."""
    slot = slots.by_id.get(default_id(slots.settings, "chat") or "")
    usage = slots.pool.usage()
    if slot is None or any(e.model_id == slot.id for e in usage.entries):
        return None
    weights = estimate_weights(slot.entry)
    need = weights + slot.prompt_cache_cap()
    pinned = sum(
        e.fixed + e.kv
        for e in usage.entries
        if (other := slots.by_id.get(e.model_id)) is not None and other.pinned
    )
    if need + pinned <= usage.budget:
        return None
    return (
        f"[memory] budget ({format_bytes(usage.budget)}) can never hold the default model "
        f"{slot.id}: it needs {format_bytes(need)} (weights {format_bytes(weights)} + prompt "
        f"cache {format_bytes(need - weights)})"
        + (f" and pinned models hold {format_bytes(pinned)}" if pinned else "")
        + "; every request for it gets 400 model_too_large. Raise [memory] budget"
        + (", unpin a model" if pinned else "")
        + " or lower [prompt_cache] max_bytes."
    )


class Fit:
    """Evictions that keep the loaded models inside the budget; see the module docstring."""

    def __init__(self, slots: Slots, unloads: Unloads):
        self._slots = slots
        self._unloads = unloads

    def start(self, detail: str) -> list[asyncio.Future[None]]:
        """Start unloading idle unpinned models (LRU first) until the reservations fit."""
        slots = self._slots
        pool = slots.pool
        usage = pool.usage()
        fixed = {e.model_id: e.fixed for e in usage.entries}
        leaving = {s.id for s in slots.by_id.values() if s.state == "unloading"}
        held = sum(n for i, n in fixed.items() if i not in leaving)
        started: list[asyncio.Future[None]] = []
        chosen: set[str] = set()
        while held >= usage.budget:
            victim = idle_victim(slots, chosen)
            if victim is None:
                break
            chosen.add(victim.id)
            held -= fixed.get(victim.id, 0)
            started.append(self._unloads.start(victim, "evicted", detail))
        return started

    async def now(self, detail: str) -> list[str]:
        """:meth:`start`, and wait for those unloads; returns the ids unloaded."""
        before = {s.id for s in self._slots.by_id.values() if s.state == "loaded"}
        tasks = self.start(detail)
        for task in tasks:
            await asyncio.shield(task)
        after = {s.id for s in self._slots.by_id.values() if s.state == "loaded"}
        return sorted(before - after)

    async def room_for(self, slot: Slot) -> bool:
        """Unload one idle unpinned model other than ``slot`` when the others' reservations
        keep ``slot``'s KV below its own ``kv_budget``; True when one was unloaded."""
        pool = self._slots.pool
        own = slot.settings.batch.kv_budget
        if own != "auto" and own <= pool.kv_ceiling(slot.id):
            return False  # its own kv_budget binds: unloading others frees nothing it may use
        victim = idle_victim(self._slots, {slot.id})
        if victim is None:
            return False
        detail = f"to make KV room for a request to {slot.id}"
        await asyncio.shield(self._unloads.start(victim, "evicted", detail))
        return True
