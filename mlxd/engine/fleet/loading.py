"""Loading a model on demand: one load task per slot that every request for it waits on.

A request for a model that is not loaded starts its load (or joins the one
under way); the load makes room in the budget (:mod:`mlxd.engine.fleet.room`),
then asks the engine to load, and settles the reservation to the bytes the
load measured. A failed load answers every waiter with 503 and is
remembered for a few seconds. A model a reload removes while requests wait
for its load refuses them at once (404), and a load still waiting for memory
gives up. A model its engine loads at start (pinned) is
only accounted for here when that load ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mlxd.config import format_bytes
from mlxd.engine.fleet.room import Room
from mlxd.engine.fleet.slot import Slot, estimate_weights, swallow_failure
from mlxd.engine.fleet.slots import Slots, removed
from mlxd.engine.fleet.values import FleetRefusal
from mlxd.engine.messages import Failed

logger = logging.getLogger(__name__)

# A failed load is not retried for this long: requests get its error at once.
RETRY_AFTER_FAILURE_S = 5.0


class Loads:
    """Starts loads and settles them; see the module docstring."""

    def __init__(self, slots: Slots, room: Room):
        self._slots = slots
        self._room = room

    async def ensure_loaded(self, slot: Slot) -> None:
        """Return once ``slot``'s model is loaded, loading it if needed; raises FleetRefusal."""
        slots = self._slots
        while True:
            if slot.removed:
                raise FleetRefusal(removed(slot))
            if slot.state == "loaded":
                return
            if slot.state == "failed" and time.time() - slot.failed_at < RETRY_AFTER_FAILURE_S:
                raise FleetRefusal(self.failure(slot))
            waiting = sum(s.waiting for s in slots.by_id.values())
            limit = slots.settings.limits.max_queued
            if waiting >= limit:
                raise FleetRefusal(
                    Failed(
                        "queue_full",
                        f"{waiting} requests already wait for models to load "
                        f"([limits] max_queued = {limit}); retry shortly.",
                        429,
                        retry_after=5,
                    )
                )
            if slot.task is None or slot.task.done():
                self.spawn(slot)
            task = slot.task
            if task is None:  # a start-up load the fleet's task has not picked up yet
                await slots.wait_change()
                continue
            slot.waiting += 1
            try:
                await asyncio.shield(task)
            finally:
                slot.waiting -= 1

    def spawn(self, slot: Slot) -> None:
        """Start loading ``slot`` as its task, unless it is loaded or a load is under way."""
        if slot.state in ("loaded", "loading"):
            return
        if slot.state == "unloading" and slot.task is not None and not slot.task.done():
            return  # the waiter loops: once unloaded, it starts the load
        task = asyncio.ensure_future(self._load(slot))
        task.add_done_callback(swallow_failure)
        slot.task = task

    def failure(self, slot: Slot) -> Failed:
        return Failed(
            "model_load_failed", f"The model '{slot.id}' could not be loaded: {slot.error}", 503
        )

    async def settle_start(self, slot: Slot) -> None:
        """A model its engine loads at start (pinned): account for it when done."""
        slots = self._slots
        started = time.monotonic()
        engine = slot.engine
        await asyncio.to_thread(engine.wait_loaded)
        error = engine.load_error
        if error is None:
            info = engine.info
            self._loaded(slot, info.weights_bytes if info else 0, time.monotonic() - started)
            pool = slots.pool.usage()
            if pool.used > pool.budget:
                logger.warning(
                    "the pinned models hold %s, more than [memory] budget (%s)",
                    format_bytes(pool.used),
                    format_bytes(pool.budget),
                )
            return
        slots.pool.release(slot.id)
        slot.state, slot.error, slot.failed_at = "failed", error, time.time()
        slots.event(slot.id, "load_failed", error)
        slots.notify()

    async def _load(self, slot: Slot) -> None:
        slots = self._slots
        slot.state, slot.error = "loading", None
        slots.notify()
        weights = estimate_weights(slot.entry)
        need = weights + slot.prompt_cache_cap()
        try:
            await self._room.make(slot, need, weights)
            started = time.monotonic()
            info = await asyncio.wrap_future(slot.engine.load(slot.settings))
        except FleetRefusal:
            slots.pool.release(slot.id)
            slot.state, slot.wait_reason = "unloaded", None
            slots.notify()
            raise
        except Exception as exc:
            slots.pool.release(slot.id)
            slot.state, slot.error, slot.failed_at = "failed", _reason(exc), time.time()
            slot.wait_reason = None
            slots.event(slot.id, "load_failed", slot.error)
            logger.error("loading model %s failed: %s", slot.id, slot.error)
            slots.notify()
            raise FleetRefusal(self.failure(slot)) from None
        self._loaded(slot, info.weights_bytes, time.monotonic() - started)

    def _loaded(self, slot: Slot, weights: int, seconds: float) -> None:
        slots = self._slots
        slots.pool.settle(slot.id, weights + slot.prompt_cache_cap())
        slot.state, slot.wait_reason = "loaded", None
        slot.loaded_at, slot.load_seconds = time.time(), seconds
        slot.last_used = slot.last_used or time.time()
        slots.event(slot.id, "loaded", f"{format_bytes(weights)} of weights in {seconds:.1f}s")
        logger.info("model %s loaded (%s in %.1fs)", slot.id, format_bytes(weights), seconds)
        slots.notify()


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
