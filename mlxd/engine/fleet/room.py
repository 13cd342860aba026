"""Making room in the memory budget for a load: reserve, evict the least recently used, or wait.

A load reserves its model's bytes (weights plus prompt-cache cap) before it
starts, so two loads never overbook. When they do not fit, idle unpinned
models are unloaded, least recently used first, one at a time; when only
busy models stand in the way, the load waits in a FIFO (its ``wait_reason``)
and looks again whenever a lease ends or a model unloads. A model that could
not fit even with every unpinned model gone is refused with the numbers.
"""

from __future__ import annotations

import asyncio

from mlxd.config import format_bytes
from mlxd.engine.fleet.fit import idle_victim
from mlxd.engine.fleet.slot import Slot
from mlxd.engine.fleet.slots import Slots, removed
from mlxd.engine.fleet.unloading import Unloads
from mlxd.engine.fleet.values import FleetRefusal
from mlxd.engine.messages import Failed


class Room:
    """Reserves a loading model's bytes; see the module docstring."""

    def __init__(self, slots: Slots, unloads: Unloads):
        self._slots = slots
        self._unloads = unloads

    async def make(self, slot: Slot, need: int, weights: int) -> None:
        """Reserve ``need`` bytes for ``slot``: unload idle models, wait while busy ones hold it.

        Raises:
            FleetRefusal: 400 ``model_too_large``: ``need`` and the pinned models
                together exceed the budget, so the model can never load.
        """
        slots = self._slots
        pool = slots.pool.usage()
        others = {s.id for s in slots.by_id.values() if s is not slot and s.pinned}
        pinned = sum(e.fixed + e.kv for e in pool.entries if e.model_id in others)
        budget = pool.budget
        if need + pinned > budget:
            raise FleetRefusal(
                Failed(
                    "model_too_large",
                    f"The model '{slot.id}' needs {format_bytes(need)} (weights "
                    f"{format_bytes(weights)} + prompt cache {format_bytes(need - weights)}), "
                    f"but [memory] budget is {format_bytes(budget)}"
                    + (f", of which pinned models hold {format_bytes(pinned)}" if pinned else "")
                    + "; it can never be loaded. Raise [memory] budget"
                    + (" or unpin a model." if pinned else "."),
                    400,
                    param="model",
                )
            )
        queue = slots.memory_queue
        queue.append(slot)
        try:
            while True:
                if slot.removed:  # a reload removed it: nobody waits for this load any more
                    raise FleetRefusal(removed(slot))
                if queue[0] is slot:
                    if slots.pool.reserve(slot.id, need):
                        return
                    victim = idle_victim(slots, {slot.id})
                    if victim is not None:
                        detail = f"to make room for {slot.id}"
                        await asyncio.shield(self._unloads.start(victim, "evicted", detail))
                        continue
                    slot.wait_reason = self._wait_reason(need)
                else:
                    slot.wait_reason = f"waiting behind {queue[0].id} for memory"
                await slots.wait_change()
        finally:
            queue.remove(slot)
            slots.notify()

    def _wait_reason(self, need: int) -> str:
        slots = self._slots
        busy = [s.id for s in slots.by_id.values() if s.state == "loaded" and s.busy]
        return (
            f"waiting for memory: needs {format_bytes(need)}, "
            f"{format_bytes(slots.pool.usage().free)} free; "
            f"in use: {', '.join(busy) or 'nothing evictable'}"
        )
