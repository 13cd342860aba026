"""The fleet: every configured model, loaded on demand inside one memory budget.

One :class:`~mlxd.engine.fleet.slot.Slot` per ``[models.<id>]`` entry (or
the one ``[model]``). The fleet runs on the HTTP side's event loop: every
decision (route a request, start a load, pick a victim, unload an idle
model) is made there, between awaits, so slots need no lock. Each model has
one engine for the life of its entry, a chat model's
:class:`~mlxd.engine.chat.engine.Engine` or an embedding model's
:class:`~mlxd.engine.embeddings.engine.EmbeddingEngine`, with its own
thread that owns the model's MLX state; the fleet drives both through
:class:`~mlxd.engine.model_engine.ModelEngine` (load, unload, apply, stop),
so requests for different models run on different threads and one model's
long prefill never holds another model's step.

The parts, each in its module: the slots, routing and events
(:mod:`~mlxd.engine.fleet.slots`), loads (:mod:`~mlxd.engine.fleet.loading`)
and the room they make in the budget (:mod:`~mlxd.engine.fleet.room`,
:mod:`~mlxd.engine.memory`), unloads and keep_alive
(:mod:`~mlxd.engine.fleet.unloading`), the admin actions
(:mod:`~mlxd.engine.fleet.admin`), keeping inside a shrunk budget
(:mod:`~mlxd.engine.fleet.fit`), a reloaded registry
(:mod:`~mlxd.engine.fleet.reload`) and the views (:mod:`~mlxd.engine.fleet.status`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

from mlxd.config import Settings
from mlxd.config.registry import default_id, registry
from mlxd.engine.chat.engine import Engine, forget_engine_thread_arrays
from mlxd.engine.fleet.admin import Admin
from mlxd.engine.fleet.fit import Fit
from mlxd.engine.fleet.loading import Loads
from mlxd.engine.fleet.reload import RegistryReload
from mlxd.engine.fleet.room import Room
from mlxd.engine.fleet.slot import Lease, Slot, budget_bytes
from mlxd.engine.fleet.slots import TICK_S, EngineMaker, Slots, removed
from mlxd.engine.fleet.status import chat_snapshots, fleet_view
from mlxd.engine.fleet.unloading import Unloads
from mlxd.engine.fleet.values import FleetApplied, FleetRefusal, FleetStatus, ModelState
from mlxd.engine.memory import MemoryPool
from mlxd.engine.messages import Failed
from mlxd.engine.snapshot import Snapshot

if TYPE_CHECKING:
    from mlxd.engine.embeddings.engine import EmbeddingEngine
    from mlxd.engine.model_engine import AnyEngine


class Fleet:
    """Every configured model; see the module docstring.

    Args:
        settings: The running settings (the registry, ``[memory]``).
        device_bytes: Device memory, for ``budget = "auto"``.
        make_engine: Builds a chat model's engine:
            ``make_engine(settings, model_id, pool, load_at_start)``.
        make_embedding: Builds an embedding model's engine:
            ``make_embedding(settings, model_id)``; it loads when the fleet says.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        device_bytes: int,
        make_engine: Callable[[Settings, str, MemoryPool, bool], AnyEngine],
        make_embedding: Callable[[Settings, str], AnyEngine] | None = None,
    ):
        self.pool = MemoryPool(budget_bytes(settings, device_bytes))
        embedding = make_embedding or _embedding_engine
        makers = {
            "chat": EngineMaker(make_engine, loads_at_start=True),
            "embedding": EngineMaker(
                lambda s, model_id, pool, at_start: embedding(s, model_id), loads_at_start=False
            ),
            "rerank": EngineMaker(
                lambda s, model_id, pool, at_start: _rerank_engine(s, model_id),
                loads_at_start=False,
            ),
            "transcription": EngineMaker(
                lambda s, model_id, pool, at_start: _transcription_engine(s, model_id),
                loads_at_start=False,
            ),
            "speech": EngineMaker(
                lambda s, model_id, pool, at_start: _speech_engine(s, model_id),
                loads_at_start=False,
            ),
        }
        self._slots = slots = Slots(settings, self.pool, makers)
        self._unloads = Unloads(slots)
        self._loads = Loads(slots, Room(slots, self._unloads))
        self._admin = Admin(slots, self._loads, self._unloads)
        self._fit = Fit(slots, self._unloads)
        self._reload = RegistryReload(slots, self._loads, self._unloads, self._fit, device_bytes)
        for model_id in registry(settings):
            slots.add(model_id, settings)
        # Set by refuse_waiting (a shutdown): requests waiting for a load get it at once.
        self._closed: Failed | None = None
        self._closing = asyncio.Event()

    @property
    def settings(self) -> Settings:
        return self._slots.settings

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start every engine's threads; pinned chat models load right away."""
        for slot in self._slots.by_id.values():
            slot.engine.start()

    async def run(self) -> None:
        """The fleet's own task: settle the start-up loads, then keep_alive and waiters."""
        slots = self._slots
        slots.open()
        for slot in [s for s in slots.by_id.values() if s.state == "loading"]:
            slot.task = asyncio.ensure_future(self._loads.settle_start(slot))
        for slot in list(slots.by_id.values()):
            if slot.pinned and slot.state == "unloaded":
                self._loads.spawn(slot)
        while True:
            await asyncio.sleep(TICK_S)
            self._unloads.expire_idle()
            self._fit.start("to fit [memory] budget")
            slots.notify()

    def stop(self) -> None:
        """Stop every engine (the process is leaving): all are asked, then each is awaited."""
        engines = [slot.engine for slot in self._slots.by_id.values()]
        for engine in engines:
            if isinstance(engine, Engine):
                engine.begin_stop()
        chat = [engine for engine in engines if isinstance(engine, Engine)]
        for engine in chat:
            engine.stop(forget=False)
        if any(not engine.alive for engine in chat):
            forget_engine_thread_arrays()
        for engine in engines:
            if not isinstance(engine, Engine):
                engine.stop()

    async def apply(self, settings: Settings) -> FleetApplied:
        """Adopt a reloaded registry (:mod:`mlxd.engine.fleet.reload`); see FleetApplied."""
        return await self._reload.apply(settings)

    def engines(self) -> list[Engine]:
        """Every chat model's engine (they live as long as their entry)."""
        return [s.engine for s in self._slots.by_id.values() if isinstance(s.engine, Engine)]

    def primary(self) -> Engine:
        """The default chat model's engine (what the status views show)."""
        slot = self._slots.by_id.get(default_id(self.settings, "chat") or "")
        engine = slot.engine if slot is not None else None
        return engine if isinstance(engine, Engine) else self.engines()[0]

    # ------------------------------------------------------------ requests

    @overload
    async def acquire(self, name: str | None, kind: Literal["chat"] = ...) -> Lease[Engine]: ...
    @overload
    async def acquire(
        self, name: str | None, kind: Literal["embedding"]
    ) -> Lease[EmbeddingEngine]: ...
    @overload
    async def acquire(self, name: str | None, kind: str) -> Lease[AnyEngine]: ...

    async def acquire(self, name: str | None, kind: str = "chat") -> Lease[Any]:
        """Route ``name`` (an id or alias) to its model of ``kind``, loaded; raises FleetRefusal.

        The lease lends that kind's engine (routing refuses a model of the
        other kind), held until :meth:`Lease.release`.
        """
        if self._closed is not None:
            raise FleetRefusal(self._closed)
        slot = self._slots.route(name, kind)
        slot.active += 1
        slot.last_used = time.time()
        try:
            if slot.state != "loaded":
                await self._loaded_or_closed(slot)
        except BaseException:
            slot.active -= 1
            self._slots.notify()
            raise
        return Lease(slot, slot.engine, self._released)

    async def _loaded_or_closed(self, slot: Slot) -> None:
        load = asyncio.ensure_future(self._loads.ensure_loaded(slot))
        closed = asyncio.ensure_future(self._closing.wait())
        gone = asyncio.ensure_future(self._slots.until_removed(slot))
        try:
            done, _ = await asyncio.wait((load, closed, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            gone.cancel()
            if not load.done():
                load.cancel()  # the load itself goes on (each waiter shields it)
        if load in done:
            load.result()  # FleetRefusal when the load failed
        elif self._closed is not None:
            raise FleetRefusal(self._closed)
        else:  # a reload removed the model: its load may go on, nobody waits for it
            raise FleetRefusal(removed(slot))

    def refuse_waiting(self, failed: Failed) -> None:
        """Refuse every request waiting for a model to load, now and from now on (a shutdown)."""
        self._closed = failed
        self._closing.set()

    async def make_kv_room(self, model_id: str) -> bool:
        """Unload one idle, unpinned model other than ``model_id`` when the others'
        reservations leave it less KV than its own budget; True when one was unloaded
        (a request refused for KV room is then tried again: docs/batching.md)."""
        slot = self._slots.by_id.get(model_id)
        return slot is not None and await self._fit.room_for(slot)

    def _released(self, slot: Slot) -> None:
        slot.active -= 1
        slot.last_used = time.time()
        self._slots.notify()

    # ------------------------------------------------------------ admin

    async def load(self, model_id: str) -> ModelState:
        return await self._admin.load(model_id)

    async def unload(self, model_id: str) -> ModelState:
        return await self._admin.unload(model_id)

    async def pin(self, model_id: str, on: bool) -> ModelState:
        return self._admin.pin(model_id, on)

    def downloaded(self, model_id: str) -> None:
        """``model_id``'s files arrived (a download job): load it as configured."""
        self._admin.downloaded(model_id)

    # ------------------------------------------------------------ views

    def status(self) -> FleetStatus:
        return fleet_view(self._slots)

    def snapshots(self) -> dict[str, Snapshot]:
        """Each chat model's engine Snapshot, loaded or not."""
        return chat_snapshots(self._slots)


def _rerank_engine(settings: Settings, model_id: str) -> AnyEngine:
    from mlxd.engine.rerank.engine import RerankEngine

    return RerankEngine(settings, model_id)


def _transcription_engine(settings: Settings, model_id: str) -> AnyEngine:
    from mlxd.engine.transcription.engine import TranscriptionEngine

    return TranscriptionEngine(settings, model_id)


def _speech_engine(settings: Settings, model_id: str) -> AnyEngine:
    from mlxd.engine.speech.engine import SpeechEngine

    return SpeechEngine(settings, model_id)


def _embedding_engine(settings: Settings, model_id: str) -> AnyEngine:
    from mlxd.engine.embeddings.engine import EmbeddingEngine

    return EmbeddingEngine(settings, model_id)
