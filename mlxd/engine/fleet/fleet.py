"""The fleet: every configured model, loaded on demand inside one memory budget.

One :class:`Slot` per ``[models.<id>]`` entry (or the one ``[model]``). The
fleet runs on the HTTP side's event loop: every decision (route a request,
start a load, pick a victim, unload an idle model) is made there, between
awaits, so slots need no lock. The models' MLX state stays on their own
threads:

- a chat model has one :class:`~mlxd.engine.chat.engine.Engine` for the life of
  its entry (its engine thread, intake thread, lanes, admission, drains and
  prompt cache); loading is the engine's ``load``, unloading its
  ``unload``, both run by that thread between two of its steps. Requests
  for different models run on different threads, so one model's long
  prefill never holds another model's step;
- an embedding model's ``EmbeddingEngine`` (:mod:`mlxd.engine.embeddings.engine`)
  is started to load and stopped to unload.

Memory (:class:`~mlxd.engine.fleet.memory.MemoryPool`): a load reserves the
model's weights (estimated from its files, settled to the measured bytes)
plus its prompt-cache cap before it starts; when they do not fit, the least
recently used idle, unpinned models are unloaded first; when only busy
models stand in the way, the load waits in a FIFO until one goes idle. A
model that could never fit, even with every unpinned model unloaded, is
refused with the numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mlxd.config import Settings, format_bytes
from mlxd.config.registry import default_id, registry, resolve
from mlxd.engine.chat.engine import Engine
from mlxd.engine.fleet.memory import MemoryPool, PoolView
from mlxd.engine.fleet.reload import RegistryReload
from mlxd.engine.fleet.slot import (
    Lease,
    Slot,
    budget_bytes,
    estimate_weights,
    model_state,
    swallow_failure,
)
from mlxd.engine.fleet.values import FleetEvent, FleetRefusal, FleetView, ModelState
from mlxd.engine.messages import Failed

logger = logging.getLogger(__name__)

# How often idle models are checked against keep_alive, and waiters re-check memory.
_TICK_S = 1.0
# A failed load is not retried for this long: requests get its error at once.
_RETRY_AFTER_FAILURE_S = 5.0


class Fleet(RegistryReload):
    """Every configured model; see the module docstring.

    Args:
        settings: The running settings (the registry, ``[memory]``).
        device_bytes: Device memory, for ``budget = "auto"``.
        make_engine: Builds a chat model's engine:
            ``make_engine(settings, model_id, pool, load_at_start)``.
        make_embedding: Builds an embedding model's engine:
            ``make_embedding(settings, model_id)``.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        device_bytes: int,
        make_engine: Callable[[Settings, str, MemoryPool, bool], Any],
        make_embedding: Callable[[Settings, str], Any] | None = None,
    ):
        self.settings = settings
        self._device_bytes = device_bytes
        self._make_engine = make_engine
        self._make_embedding = make_embedding or _embedding_engine
        self.pool = MemoryPool(budget_bytes(settings, device_bytes))
        self.slots: dict[str, Slot] = {}
        self._events: deque[FleetEvent] = deque(maxlen=100)
        self._event_totals: dict[tuple[str, str], int] = {}
        self._memory_queue: deque[Slot] = deque()
        self._changed: asyncio.Event | None = None
        self._ticker: asyncio.Task | None = None
        for model_id in registry(settings):
            self._add(model_id, settings)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start every chat engine's threads; pinned chat models load right away."""
        for slot in self.slots.values():
            if slot.engine is not None:
                slot.engine.start()

    async def run(self) -> None:
        """The fleet's own task: settle the start-up loads, then keep_alive and waiters."""
        self._changed = asyncio.Event()
        starting = [s for s in self.slots.values() if s.state == "loading"]
        for slot in starting:
            slot.task = asyncio.ensure_future(self._settle_start(slot))
        for slot in self.slots.values():
            if slot.pinned and slot.state == "unloaded":
                self._spawn_load(slot)
        while True:
            await asyncio.sleep(_TICK_S)
            self._expire_idle()
            self._notify()

    def stop(self) -> None:
        """Stop every engine (the process is leaving)."""
        for slot in self.slots.values():
            if slot.engine is not None:
                slot.engine.stop()

    def engines(self) -> list[Engine]:
        """Every chat model's engine (they live as long as their entry)."""
        return [
            s.engine for s in self.slots.values() if s.engine is not None and s.entry.kind == "chat"
        ]

    def primary(self) -> Engine:
        """The default chat model's engine (what the status views show)."""
        model_id = default_id(self.settings, "chat")
        slot = self.slots.get(model_id or "")
        if slot is None or slot.engine is None:
            slot = next(s for s in self.slots.values() if s.entry.kind == "chat")
        return slot.engine

    # ------------------------------------------------------------ requests

    async def acquire(self, name: str | None, kind: str = "chat") -> Lease:
        """Route ``name`` (an id or alias) to its model, loaded; raises FleetRefusal."""
        slot = self._route(name, kind)
        slot.active += 1
        slot.last_used = time.time()
        try:
            await self._ensure_loaded(slot)
        except BaseException:
            slot.active -= 1
            self._notify()
            raise
        return Lease(slot, self._released)

    def _route(self, name: str | None, kind: str) -> Slot:
        model_id = resolve(self.settings, name, kind)
        slot = self.slots.get(model_id or "")
        if slot is None or slot.removed:
            ids = [i for i, s in self.slots.items() if not s.removed and s.entry.kind == kind]
            raise FleetRefusal(
                Failed(
                    "model_not_found",
                    f"The model '{name or ''}' does not exist. This server serves "
                    + (", ".join(f"'{i}'" for i in ids) or f"no {kind} models")
                    + " (see /v1/models).",
                    404,
                    param="model",
                )
            )
        if slot.entry.kind != kind:
            message = self._kind_message(slot)
            raise FleetRefusal(Failed("model_kind_mismatch", message, 400, param="model"))
        return slot

    def _kind_message(self, slot: Slot) -> str:
        by_kind: dict[str, list[str]] = {}
        for i, s in self.slots.items():
            if not s.removed:
                by_kind.setdefault(s.entry.kind, []).append(i)
        where = {"chat": "the chat routes", "embedding": "/v1/embeddings"}
        served = "; ".join(
            f"{where[k]} serve{'s' if k == 'embedding' else ''} {', '.join(ids)}"
            for k, ids in sorted(by_kind.items())
        )
        return (
            f"'{slot.id}' is a{'n' if slot.entry.kind == 'embedding' else ''} "
            f"{slot.entry.kind} model, served at {where[slot.entry.kind]}. {served}."
        )

    def _released(self, slot: Slot) -> None:
        slot.active -= 1
        slot.last_used = time.time()
        self._notify()

    # ------------------------------------------------------------ loading

    async def _ensure_loaded(self, slot: Slot) -> None:
        while True:
            if slot.state == "loaded" and slot.engine is not None:
                return
            if slot.state == "failed" and time.time() - slot.failed_at < _RETRY_AFTER_FAILURE_S:
                raise FleetRefusal(self._load_failure(slot))
            waiting = sum(s.waiting for s in self.slots.values())
            limit = self.settings.limits.max_queued
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
                self._spawn_load(slot)
            if slot.task is None:  # a start-up load the fleet's task has not picked up yet
                await self._wait_change()
                continue
            slot.waiting += 1
            try:
                await asyncio.shield(slot.task)
            finally:
                slot.waiting -= 1

    def _spawn_load(self, slot: Slot) -> None:
        if slot.state in ("loaded", "loading"):
            return
        if slot.state == "unloading" and slot.task is not None and not slot.task.done():
            return  # the waiter loops: once unloaded, it starts the load
        slot.task = asyncio.ensure_future(self._load(slot))
        slot.task.add_done_callback(swallow_failure)

    def _load_failure(self, slot: Slot) -> Failed:
        return Failed(
            "model_load_failed", f"The model '{slot.id}' could not be loaded: {slot.error}", 503
        )

    async def _load(self, slot: Slot) -> None:
        slot.state, slot.error = "loading", None
        self._notify()
        weights = estimate_weights(slot.entry)
        need = weights + slot.prompt_cache_cap()
        try:
            await self._make_room(slot, need, weights)
            started = time.monotonic()
            if slot.entry.kind == "chat":
                info = await asyncio.wrap_future(slot.engine.load(slot.settings))
                measured = info.weights_bytes
            else:
                slot.engine = engine = self._make_embedding(slot.settings, slot.id)
                engine.start()
                await asyncio.to_thread(engine.wait_loaded)
                if engine.load_error:
                    error = engine.load_error
                    await asyncio.to_thread(engine.stop)
                    slot.engine = None
                    raise RuntimeError(error)
                measured = engine.weights_bytes
        except FleetRefusal:
            self.pool.release(slot.id)
            slot.state, slot.wait_reason = "unloaded", None
            self._notify()
            raise
        except Exception as exc:
            self.pool.release(slot.id)
            slot.state, slot.error, slot.failed_at = "failed", _reason(exc), time.time()
            slot.wait_reason = None
            self._event(slot.id, "load_failed", slot.error)
            logger.error("loading model %s failed: %s", slot.id, slot.error)
            self._notify()
            raise FleetRefusal(self._load_failure(slot)) from None
        self._loaded(slot, measured, time.monotonic() - started)

    def _loaded(self, slot: Slot, weights: int, seconds: float) -> None:
        self.pool.settle(slot.id, weights + slot.prompt_cache_cap())
        slot.state, slot.wait_reason = "loaded", None
        slot.loaded_at, slot.load_seconds = time.time(), seconds
        slot.last_used = slot.last_used or time.time()
        self._event(slot.id, "loaded", f"{format_bytes(weights)} of weights in {seconds:.1f}s")
        logger.info("model %s loaded (%s in %.1fs)", slot.id, format_bytes(weights), seconds)
        self._notify()

    async def _settle_start(self, slot: Slot) -> None:
        """A chat model its engine loads at start (pinned): account for it when done."""
        started = time.monotonic()
        await asyncio.to_thread(slot.engine.wait_loaded)
        error = slot.engine.load_error
        if error is None:
            self._loaded(slot, slot.engine.weights_bytes, time.monotonic() - started)
            pool = self.pool.view()
            if pool.used > pool.budget:
                logger.warning(
                    "the pinned models hold %s, more than [memory] budget (%s)",
                    format_bytes(pool.used),
                    format_bytes(pool.budget),
                )
            return
        self.pool.release(slot.id)
        slot.state, slot.error, slot.failed_at = "failed", error, time.time()
        self._event(slot.id, "load_failed", error)
        self._notify()

    async def _make_room(self, slot: Slot, need: int, weights: int) -> None:
        """Reserve ``need`` bytes for ``slot``: unload idle models, wait while busy ones hold it."""
        pool = self.pool.view()
        others = {s.id for s in self.slots.values() if s is not slot and s.pinned}
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
        self._memory_queue.append(slot)
        try:
            while True:
                if self._memory_queue[0] is slot:
                    if self.pool.reserve(slot.id, need):
                        return
                    victim = self._victim(slot)
                    if victim is not None:
                        detail = f"to make room for {slot.id}"
                        await asyncio.shield(self._unloading(victim, "evicted", detail))
                        continue
                    slot.wait_reason = self._wait_reason(need)
                else:
                    slot.wait_reason = f"waiting behind {self._memory_queue[0].id} for memory"
                await self._wait_change()
        finally:
            self._memory_queue.remove(slot)
            self._notify()

    def _victim(self, loading: Slot) -> Slot | None:
        """The least recently used loaded model that nobody uses and nobody pinned."""
        idle = [
            s
            for s in self.slots.values()
            if s is not loading and s.state == "loaded" and not s.pinned and not s.busy
        ]
        return min(idle, key=lambda s: s.last_used or 0.0, default=None)

    def _wait_reason(self, need: int) -> str:
        busy = [s.id for s in self.slots.values() if s.state == "loaded" and s.busy]
        return (
            f"waiting for memory: needs {format_bytes(need)}, {format_bytes(self.pool.view().free)}"
            f" free; in use: {', '.join(busy) or 'nothing evictable'}"
        )

    # ------------------------------------------------------------ unloading

    def _unloading(self, slot: Slot, kind: str, detail: str = "") -> asyncio.Future:
        """Start unloading ``slot`` as its task: its requests wait for it, then load again."""
        slot.state = "unloading"
        slot.task = asyncio.ensure_future(self._unload(slot, kind, detail))
        slot.task.add_done_callback(swallow_failure)
        return slot.task

    async def _unload(self, slot: Slot, kind: str, detail: str = "") -> None:
        """Let ``slot``'s requests finish, then unload it and free its bytes."""
        slot.state = "unloading"
        self._notify()
        try:
            while slot.active > 0:
                await self._wait_change()
            engine = slot.engine
            if slot.entry.kind == "chat":
                await asyncio.wrap_future(engine.unload())
            elif engine is not None:
                await asyncio.to_thread(engine.stop)
                slot.engine = None
        finally:
            self.pool.release(slot.id)
            slot.state, slot.loaded_at = "unloaded", None
            self._event(slot.id, kind, detail)
            logger.info("model %s unloaded (%s%s)", slot.id, kind, f": {detail}" if detail else "")
            self._notify()

    def _expire_idle(self) -> None:
        now = time.time()
        for slot in self.slots.values():
            keep = slot.entry.keep_alive
            if slot.state != "loaded" or slot.pinned or keep == "forever" or slot.busy:
                continue
            if now - (slot.last_used or now) >= float(keep):
                self._unloading(slot, "idle", f"unused for {float(keep):g}s (keep_alive)")

    # ------------------------------------------------------------ admin

    async def load(self, model_id: str) -> ModelState:
        slot = self._slot(model_id)
        await self._ensure_loaded(slot)
        return self._state(slot)

    async def unload(self, model_id: str) -> ModelState:
        slot = self._slot(model_id)
        if slot.pinned:
            raise FleetRefusal(
                Failed("model_pinned", f"'{model_id}' is pinned; unpin it first.", 409)
            )
        if slot.state == "loading" and slot.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(slot.task)
        if slot.state == "loaded":
            await asyncio.shield(self._unloading(slot, "unloaded", "by an admin"))
        return self._state(slot)

    async def pin(self, model_id: str, on: bool) -> ModelState:
        slot = self._slot(model_id)
        slot.pin_override = on
        self._event(model_id, "pinned" if on else "unpinned", "by an admin")
        if on and slot.state in ("unloaded", "failed"):
            self._spawn_load(slot)
        self._notify()
        return self._state(slot)

    def _slot(self, model_id: str) -> Slot:
        slot = self.slots.get(model_id)
        if slot is None or slot.removed:
            raise FleetRefusal(
                Failed(
                    "model_not_found",
                    f"No model '{model_id}' is configured (known: {', '.join(self.slots)}).",
                    404,
                    param="model",
                )
            )
        return slot

    # ------------------------------------------------------------ views

    def view(self) -> FleetView:
        pool = self.pool.view()
        return FleetView(
            budget_bytes=pool.budget,
            used_bytes=pool.used,
            models=tuple(self._state(s, pool) for s in self.slots.values()),
            events=tuple(self._events),
            memory_queue=tuple(s.id for s in self._memory_queue),
            event_totals=tuple((m, k, n) for (m, k), n in self._event_totals.items()),
        )

    def snapshots(self) -> dict[str, Any]:
        """Each chat model's engine Snapshot, loaded or not."""
        return {
            i: s.engine.snapshot()
            for i, s in self.slots.items()
            if s.entry.kind == "chat" and s.engine is not None
        }

    def _state(self, slot: Slot, pool: PoolView | None = None) -> ModelState:
        default = slot.id == default_id(self.settings, slot.entry.kind)
        return model_state(slot, pool or self.pool.view(), default)

    # ------------------------------------------------------------ plumbing

    def _event(self, model_id: str, kind: str, detail: str = "") -> None:
        self._events.append(FleetEvent(time.time(), model_id, kind, detail))
        key = (model_id, kind)
        self._event_totals[key] = self._event_totals.get(key, 0) + 1

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _wait_change(self) -> None:
        """Until something changes (a lease ends, a model unloads), or a tick passes."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), _TICK_S)


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _embedding_engine(settings: Settings, model_id: str) -> Any:
    try:
        from mlxd.engine.embeddings.engine import EmbeddingEngine
    except ImportError as exc:
        raise RuntimeError(f"embedding models are not available in this build: {exc}") from exc
    return EmbeddingEngine(settings, model_id)
