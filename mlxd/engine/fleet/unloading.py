"""Unloading a model: after its last lease, by eviction, keep_alive, an admin or a reload.

An unload is the slot's task while it runs, so requests that come meanwhile
wait for it and then load the model again. It waits for the model's leases
to end, then has the engine drop the model (its thread stays) and frees the
model's bytes in the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mlxd.engine.fleet.slot import Slot, swallow_failure
from mlxd.engine.fleet.slots import Slots

logger = logging.getLogger(__name__)


class Unloads:
    """Starts unloads and checks keep_alive; see the module docstring."""

    def __init__(self, slots: Slots):
        self._slots = slots

    def start(self, slot: Slot, event: str, detail: str = "") -> asyncio.Future[None]:
        """Start unloading ``slot`` as its task; ``event`` (evicted, idle, ...) is logged."""
        slot.state = "unloading"
        task = asyncio.ensure_future(self._unload(slot, event, detail))
        task.add_done_callback(swallow_failure)
        slot.task = task
        return task

    async def _unload(self, slot: Slot, event: str, detail: str) -> None:
        """Let ``slot``'s requests finish, then unload it and free its bytes."""
        slots = self._slots
        slot.state = "unloading"
        slots.notify()
        try:
            while slot.active > 0:
                await slots.wait_change()
            await asyncio.wrap_future(slot.engine.unload())
        finally:
            slots.pool.release(slot.id)
            slot.state, slot.loaded_at = "unloaded", None
            slots.event(slot.id, event, detail)
            logger.info("model %s unloaded (%s%s)", slot.id, event, f": {detail}" if detail else "")
            slots.notify()

    def expire_idle(self) -> None:
        """Unload every loaded, unpinned model unused for longer than its keep_alive."""
        now = time.time()
        for slot in list(self._slots.by_id.values()):
            keep = slot.entry.keep_alive
            if slot.state != "loaded" or slot.pinned or keep == "forever" or slot.busy:
                continue
            if now - (slot.last_used or now) >= float(keep):
                self.start(slot, "idle", f"unused for {float(keep):g}s (keep_alive)")
