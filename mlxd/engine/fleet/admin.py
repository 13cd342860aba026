"""The admin actions on one model (the dashboard's ``POST /dashboard/models/load``,
``/unload``, ``/pin``): load, unload, pin; a model whose download finished
(``POST /admin/models/{id}/pull``).

Each acts on a configured id (not an alias), waits for what it started, and
answers with the model's row as the views show it. Refusals are
:class:`~mlxd.engine.fleet.values.FleetRefusal`: an unknown id (404), a
pinned model to unload (409), a load that fails or cannot fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from mlxd.engine.fleet.loading import Loads
from mlxd.engine.fleet.slots import Slots
from mlxd.engine.fleet.status import state_of
from mlxd.engine.fleet.unloading import Unloads
from mlxd.engine.fleet.values import FleetRefusal, ModelState
from mlxd.engine.messages import Failed

logger = logging.getLogger(__name__)


class Admin:
    """An operator's actions on the fleet's models; see the module docstring."""

    def __init__(self, slots: Slots, loads: Loads, unloads: Unloads):
        self._slots = slots
        self._loads = loads
        self._unloads = unloads

    async def load(self, model_id: str) -> ModelState:
        """Load ``model_id`` now (making room as a request would)."""
        slot = self._slots.find(model_id)
        await self._loads.ensure_loaded(slot)
        return state_of(self._slots, slot)

    async def unload(self, model_id: str) -> ModelState:
        """Unload ``model_id`` once its requests are done (a load under way ends first)."""
        slot = self._slots.find(model_id)
        if slot.pinned:
            raise FleetRefusal(
                Failed("model_pinned", f"'{model_id}' is pinned; unpin it first.", 409)
            )
        if slot.state == "loading" and slot.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(slot.task)
        if slot.state == "loaded":
            await asyncio.shield(self._unloads.start(slot, "unloaded", "by an admin"))
        return state_of(self._slots, slot)

    def pin(self, model_id: str, on: bool) -> ModelState:
        """Pin (load now, never evict) or unpin ``model_id``, over its entry's ``pin``."""
        slot = self._slots.find(model_id)
        slot.pin_override = on
        self._slots.event(model_id, "pinned" if on else "unpinned", "by an admin")
        logger.info("model %s %s (by an admin)", model_id, "pinned" if on else "unpinned")
        if on and slot.state in ("unloaded", "failed"):
            self._loads.spawn(slot)
        self._slots.notify()
        return state_of(self._slots, slot)

    def downloaded(self, model_id: str) -> None:
        """A download job brought ``model_id``'s files: forget its failed load (the missing
        files); a pinned model loads now, any other on its next request."""
        slot = self._slots.by_id.get(model_id)
        if slot is None or slot.removed:
            return
        if slot.state == "failed":
            slot.state, slot.error, slot.failed_at = "unloaded", None, 0.0
        if slot.pinned and slot.state == "unloaded":
            self._loads.spawn(slot)
        self._slots.notify()
