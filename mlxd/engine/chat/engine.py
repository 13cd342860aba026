"""The engine: one thread that owns MLX, and the thread-safe ways to talk to it.

Everything that touches the model goes through the engine thread: requests
(``submit``), cancels (``cancel``), and any other work (``call``; with
``exclusive=True`` it first drains both lanes, which is how a model is
swapped). Readers take :meth:`Engine.snapshot`, an immutable value swapped
in after every step, and never wait on the loop.

Tokenizing a request can take a second for a long prompt, so the engine
thread hands each new request to its intake thread, which tokenizes and
checks it (``intake.prepare``: the tokenizer and pure checks, no MLX) and
sends it back; the engine thread keeps stepping meanwhile, and queues the
request when it returns. A request tokenized by a model that was swapped
out in the meantime is prepared again by the new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from mlxd.config import ModelSettings, Settings
from mlxd.engine.channel import Channel, RequestHandle
from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.intake_thread import Intaken, IntakeThread
from mlxd.engine.chat.loading import LoadedModel, ModelLoadError, load_model
from mlxd.engine.chat.snapshots import build_snapshot
from mlxd.engine.cluster.join import ClusterError
from mlxd.engine.cluster.plan import PeerLost
from mlxd.engine.fleet.memory import MemoryPool
from mlxd.engine.messages import Constraint, Failed, GenerationRequest, ModelInfo
from mlxd.engine.snapshot import Snapshot

if TYPE_CHECKING:
    from mlxd.engine.cluster.leader import Leader

logger = logging.getLogger(__name__)

T = TypeVar("T")

_IDLE_WAIT_S = 0.5
# In a cluster, an idle rank 0 sends an empty plan this often (the heartbeat).
_HEARTBEAT_S = 0.1
# Woken from idle by a request, the engine keeps taking requests until the
# inbox has been quiet this long (at most _BURST_MAX_S), so a burst of clients
# is admitted and prefilled as one group instead of 1 + the rest
# (benchmarks/README.md, "Where the time goes": 5-8% at 8-16 clients).
_BURST_QUIET_S = 0.003
_BURST_MAX_S = 0.020


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    channel: Channel


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[EngineCore], Any]
    future: concurrent.futures.Future
    exclusive: bool
    reason: str


def _forget_engine_thread_arrays() -> None:
    """Free what the dead engine thread left in MLX's globals.

    Model construction and sampling replace MLX's global random key on the
    engine thread. An array made there and freed only at interpreter exit,
    after that thread's stream is gone, aborts the process, so the key is
    replaced here, on the caller's thread, and cycles are collected now.
    """
    import mlx.core as mx

    mx.random.seed(time.time_ns() & 0xFFFFFFFF)
    mx.eval(mx.random.state)
    gc.collect()


class Engine:
    """Owns the model on one thread; see the module docstring.

    Args:
        settings: The initial settings; the model section says what to load.
        optimized_blas: Whether an optimized CPU BLAS is active (picks the
            demo model's dtype on Linux).
        fault_injection: Honour ``GenerationRequest.fault`` (tests only).
        runtime: Facts about the process (BLAS, device) for the snapshot.
        cluster: Rank 0 of a cluster (docs/cluster.md): the engine joins the
            group, loads its shard, and broadcasts each step to the other
            ranks. ``None`` runs on this machine alone.
        pool: The memory budget shared with the other loaded models
            (:mod:`mlxd.engine.fleet.memory`); ``model_id`` names this engine in it.
        load_at_start: Load the model when the thread starts; otherwise the
            engine waits, unloaded, for :meth:`swap_model` (the fleet's loads).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        optimized_blas: bool = False,
        fault_injection: bool = False,
        runtime: dict[str, Any] | None = None,
        cluster: Leader | None = None,
        pool: MemoryPool | None = None,
        model_id: str = "",
        load_at_start: bool = True,
    ):
        self._core = EngineCore(settings, faults=fault_injection, runtime=runtime)
        self._core.pool, self._core.pool_id = pool, model_id
        self._load_at_start = load_at_start
        self.model_id = model_id
        suffix = f"-{model_id}" if model_id else ""
        self._cluster = cluster
        self._idle_wait = _IDLE_WAIT_S
        if cluster is not None:
            core = self._core
            core.batch_factory = cluster.batch_lane
            core.serial_factory = cluster.serial_run
            core.prompt_cache = cluster.prompt_cache(
                settings.prompt_cache, lambda: core.settings.batch
            )
            cluster.on_fatal = self._cluster_lost
            self._idle_wait = min(_IDLE_WAIT_S, _HEARTBEAT_S)
        # Called with (message, exit code) when the cluster is lost; set by the server.
        self.on_fatal: Callable[[str, int], None] = lambda message, code: None
        # Every request's channel, to end them from any thread if the cluster is lost.
        self._channels: weakref.WeakValueDictionary[str, Channel] = weakref.WeakValueDictionary()
        self._channels_lock = threading.Lock()
        self._lost = False
        self._optimized_blas = optimized_blas
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deferred: list[_Call] = []
        self._stop = threading.Event()
        self._loaded_event = threading.Event()
        self._generation = 0
        self._thread = threading.Thread(target=self._run, name=f"mlxd-engine{suffix}", daemon=True)
        # Requests handed to the intake thread, by id (engine thread only).
        self._intaking: dict[str, _Submit] = {}
        self._cancelled_in_intake: set[str] = set()
        self._intake = IntakeThread(f"mlxd-intake{suffix}", self._inbox.put)
        self._snapshot = build_snapshot(self._core, state="starting")
        self.model_info: ModelInfo | None = None
        # The loaded model's grammar compiler (no MLX state; thread-safe).
        self.grammars: Any = None

    # ------------------------------------------------------------ public API

    def start(self) -> None:
        """Start the engine thread (it loads the model itself) and the intake thread."""
        self._intake.start()
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the first model load finished (successfully or not)."""
        return self._loaded_event.wait(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """Rows running or queued, as of the latest snapshot."""
        return self._snapshot.busy

    @property
    def load_error(self) -> str | None:
        """Why the model did not load (after :meth:`wait_loaded`), else None."""
        core = self._core
        return core.model_error or "the model did not load" if core.loaded is None else None

    @property
    def weights_bytes(self) -> int:
        info = self.model_info
        return info.weights_bytes if info is not None else 0

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; call from a running event loop. Read events from the handle."""
        channel = Channel(asyncio.get_running_loop())
        if self._cluster is not None:
            with self._channels_lock:
                self._channels[request.id] = channel
        self._inbox.put(_Submit(request, channel))
        return RequestHandle(request.id, channel, self.cancel)

    async def warm_grammar(self, constraint: Constraint) -> tuple[float, bool] | str | None:
        """Compile ``constraint`` for the loaded model in a worker thread, so the
        engine thread finds it cached.

        Returns ``(seconds, was_cached)``, an error message, or None when no
        model (or no grammar support) is loaded; intake then decides.
        """
        grammars = self.grammars
        if grammars is None:
            return None
        try:
            return await asyncio.to_thread(grammars.warm, constraint)
        except ValueError as exc:
            return str(exc)

    def cancel(self, request_id: str) -> None:
        """Cancel a request; its row leaves before the next step. Thread-safe."""
        self._inbox.put(_Cancel(request_id))

    def call(
        self, fn: Callable[[EngineCore], T], *, exclusive: bool = False, reason: str = "exclusive"
    ) -> concurrent.futures.Future[T]:
        """Run ``fn(core)`` on the engine thread between two steps.

        With ``exclusive``, admission stops and ``fn`` runs once both lanes
        are idle (recorded as a drain with ``reason``). This is the one way to
        touch the model from outside: there is no second lock.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive and self._thread.ident is not None:
            future.set_exception(RuntimeError("the engine thread is not running"))
            return future
        self._inbox.put(_Call(fn, future, exclusive, reason))
        return future

    def count_tokens(self, request: GenerationRequest) -> concurrent.futures.Future[int | Failed]:
        """How many prompt tokens ``request`` has, tokenized as at intake.

        The engine thread hands the job to the intake thread with the model
        that serves now, so the count uses the same tokenizer, template and
        thread as a submitted request. A prompt that cannot be tokenized (or
        no model loaded) resolves to a :class:`Failed` value.
        """
        future: concurrent.futures.Future[int | Failed] = concurrent.futures.Future()

        def hand(core: EngineCore) -> None:
            if core.loaded is None:
                future.set_result(Failed("model_not_loaded", "No model is loaded yet.", 503))
            else:
                self._intake.count(request, core.loaded, future)

        def engine_gone(call: concurrent.futures.Future[None]) -> None:
            if call.exception() is not None and not future.done():
                future.set_exception(call.exception())  # type: ignore[arg-type]

        self.call(hand).add_done_callback(engine_gone)
        return future

    def snapshot(self) -> Snapshot:
        """The latest immutable view of the engine; never blocks."""
        return self._snapshot

    @property
    def settings(self) -> Settings:
        return self._core.settings

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's facts, or None while no model is loaded."""
        return self.model_info

    def load(self, settings: Settings) -> concurrent.futures.Future[ModelInfo]:
        """Drain both lanes, load ``settings.model`` and serve it; on failure the old one stays."""
        return self.swap_model(settings.model)

    def swap_model(self, model: ModelSettings) -> concurrent.futures.Future[ModelInfo]:
        """Drain both lanes, load ``model`` and serve it; on failure the old model stays."""
        return self.call(lambda core: self._swap(core, model), exclusive=True, reason="model_swap")

    def apply(self, settings: Settings) -> concurrent.futures.Future[None]:
        """Take new policy settings between two steps; running rows keep running."""
        return self.call(lambda core: core.apply(settings))

    def stop_accepting(self) -> concurrent.futures.Future[None]:
        """Refuse new requests from the next step on (a graceful shutdown); queued ones run."""
        return self.call(lambda core: setattr(core, "accepting", False))

    def abort_all(self, message: str) -> concurrent.futures.Future[None]:
        """End every queued and running request with ``message`` (503 shutting_down)."""
        return self.call(lambda core: core.abort_all(message))

    def clear_error(self) -> concurrent.futures.Future[None]:
        """Forget the latest engine error (a good reload clears the status bar's)."""

        def clear(core: EngineCore) -> None:
            core.last_error = core.last_error_at = None

        return self.call(clear)

    def rename(self, model_id: str) -> None:
        """Account under ``model_id`` in the shared pool from the next step on."""
        self.model_id = model_id
        self.call(lambda core: setattr(core, "pool_id", model_id))

    def unload(self) -> concurrent.futures.Future[None]:
        """Drain both lanes and drop the model; the thread waits for the next :meth:`swap_model`."""
        return self.call(self._unload, exclusive=True, reason="model_unload")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine: in-flight requests end with an error, the thread exits."""
        self._stop.set()
        self._inbox.put(None)
        self._intake.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            _forget_engine_thread_arrays()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._serve()
        except PeerLost as exc:
            self._cluster_lost(str(exc))
        except ClusterError as exc:  # refused at startup: the group cannot form
            logger.error("cluster: %s", exc)
            self._cluster_lost(str(exc), code=2)

    def _serve(self) -> None:
        core = self._core
        core.pump = self._pump
        if self._cluster is not None:
            self._join_cluster()
        self._load_initial()
        while not self._stop.is_set():
            try:
                self._drain_inbox(block=not core.busy)
                if self._stop.is_set():
                    break
                stepped = core.tick()
                if self._cluster is not None and not stepped:
                    self._cluster.heartbeat()
            except Exception as exc:  # the loop must never die silently
                logger.exception("engine loop error; failing in-flight requests and continuing")
                core.counters.engine_errors += 1
                core.note_error(f"engine loop error: {exc!r}")
                core.abort_all(f"internal engine error: {exc}", code="generation_error", status=500)
                time.sleep(0.05)
            self._publish()
        core.abort_all("the engine stopped", code="shutting_down", status=503)
        for submit in self._intaking.values():
            submit.channel.push(Failed("shutting_down", "the engine stopped", 503))
        self._intaking.clear()
        for call in self._deferred:
            call.future.set_exception(RuntimeError("the engine stopped"))
        if self._cluster is not None:
            self._cluster.shutdown()
        self._publish(state="stopped")
        core.release()
        gc.collect()
        if core.pool is not None:  # unloaded to make room: give the freed buffers back
            import mlx.core as mx

            mx.clear_cache()
        logger.info("engine stopped%s", f" ({self.model_id})" if self.model_id else "")

    def _load(self, model: ModelSettings) -> LoadedModel:
        """Load ``model``; in a cluster, every rank loads its shard together."""
        cluster = self._cluster
        if cluster is None:
            return load_model(
                model, optimized_blas=self._optimized_blas, generation=self._generation
            )
        from mlxd.engine.cluster.start import check_model, shard_loader

        # A registry entry's own keys (kind, pin, overrides) stay on rank 0.
        model = ModelSettings(**model.model_dump(include=set(ModelSettings.model_fields)))
        check_model(cluster, model, optimized_blas=self._optimized_blas)
        cluster.load(model.model_dump(), self._generation)
        try:
            return load_model(
                model,
                optimized_blas=self._optimized_blas,
                generation=self._generation,
                loader=shard_loader(cluster),
            )
        except Exception as exc:  # the other ranks are loading: no way back
            raise cluster.lost(f"rank 0 could not load its shard: {exc}") from exc

    def _join_cluster(self) -> None:
        from mlxd.engine.cluster.start import start_leader

        self._publish(state="starting")
        start_leader(self._cluster, self._core.settings, optimized_blas=self._optimized_blas)
        self._publish(state="starting")

    def _cluster_lost(self, message: str, code: int = 3) -> None:
        """The cluster cannot go on: fail every request, go not-ready, let the server exit.

        Runs on the engine thread (a collective raised) or on the watchdog's
        thread (the engine thread is stuck in a collective), so it touches
        only channels and the snapshot reference.
        """
        with self._channels_lock:
            if self._lost:
                return
            self._lost = True
        cluster = self._cluster
        if cluster is not None:
            cluster.lost(message)
            message = cluster.error or message
        failed = Failed("peer_lost", f"the cluster lost a rank: {message}", 503)
        if threading.current_thread() is self._thread:
            self._core.abort_all(failed.message, code="peer_lost", status=503)
            self._publish(state="peer_lost")
        else:
            view = cluster.view() if cluster is not None else None
            self._snapshot = replace(self._snapshot, state="peer_lost", cluster=view)
        with self._channels_lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.push(failed)
        for submit in list(self._intaking.values()):
            submit.channel.push(failed)
        self.on_fatal(message, code)

    def _load_initial(self) -> None:
        core = self._core
        if not self._load_at_start:
            core.model_status = "unloaded"
            self._loaded_event.set()
            self._publish()
            return
        try:
            loaded = self._load(core.settings.model)
        except ModelLoadError as exc:
            logger.error("%s", exc)
            core.model_status, core.model_error = "failed", str(exc)
        except Exception as exc:
            logger.exception("loading the model failed")
            core.model_status, core.model_error = "failed", f"loading the model failed: {exc!r}"
        else:
            core.install_model(loaded)
            self.grammars = loaded.grammars
            self.model_info = loaded.info
        self._loaded_event.set()
        if self._cluster is not None and core.loaded is None:
            raise ClusterError(core.model_error or "the model did not load")
        self._publish()

    def _swap(self, core: EngineCore, model: ModelSettings) -> ModelInfo:
        previous_status = core.model_status
        core.model_status = "swapping"
        self._publish()
        self._generation += 1
        try:
            loaded = self._load(model)
        except Exception as exc:
            core.model_status = previous_status if core.loaded is not None else "failed"
            core.note_error(f"model swap failed: {exc}")
            raise
        core.install_model(loaded)
        core.retokenize_queued()
        self.grammars = loaded.grammars
        self.model_info = loaded.info
        gc.collect()
        import mlx.core as mx

        mx.clear_cache()
        return loaded.info

    def _unload(self, core: EngineCore) -> None:
        if core.loaded is None:
            return
        core.release()
        core.model_status, core.model_error = "unloaded", None
        self.grammars = None
        self.model_info = None
        gc.collect()
        import mlx.core as mx

        mx.clear_cache()

    def _drain_inbox(self, *, block: bool, defer_calls: bool = False) -> None:
        try:
            first = self._inbox.get(timeout=self._idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            first = None
        messages = [first] if first is not None else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if block and isinstance(first, _Submit | Intaken):
            messages += self._burst()
        if not defer_calls and self._deferred:
            messages = [*self._deferred, *messages]
            self._deferred = []
        for message in messages:
            if message is None:
                continue
            if isinstance(message, _Submit):
                self._hand_to_intake(message)
            elif isinstance(message, Intaken):
                self._prepared(message)
            elif isinstance(message, _Cancel):
                if message.request_id in self._intaking:
                    self._cancelled_in_intake.add(message.request_id)
                else:
                    self._core.cancel(message.request_id)
            elif defer_calls:
                self._deferred.append(message)
            else:
                self._dispatch(message)

    # ------------------------------------------------------------ intake

    def _hand_to_intake(self, submit: _Submit) -> None:
        core = self._core
        if not core.accepting or core.loaded is None:
            core.intake(submit.request, submit.channel)  # refused at once, with the reason
            return
        self._intaking[submit.request.id] = submit
        core.intaking = len(self._intaking)
        self._intake.prepare(submit, core.loaded, core.settings, core.budget_bytes)

    def _prepared(self, message: Intaken) -> None:
        core = self._core
        request_id = message.submit.request.id
        self._intaking.pop(request_id, None)
        core.intaking = len(self._intaking)
        if request_id in self._cancelled_in_intake:
            self._cancelled_in_intake.discard(request_id)
            core.counters.reject("cancelled")
            return
        # Tokenized by a model that has been swapped out since: prepare again.
        prepared = message.prepared if message.loaded is core.loaded else None
        core.intake(message.submit.request, message.submit.channel, prepared)

    def _burst(self) -> list[Any]:
        """The rest of a burst: messages until the inbox is quiet (see _BURST_QUIET_S)."""
        more: list[Any] = []
        deadline = time.monotonic() + _BURST_MAX_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                more.append(self._inbox.get(timeout=min(_BURST_QUIET_S, left)))
            except queue.Empty:
                break
        return more

    def _dispatch(self, call: _Call) -> None:
        def run() -> None:
            if not call.future.set_running_or_notify_cancel():
                return
            try:
                call.future.set_result(call.fn(self._core))
            except BaseException as exc:
                call.future.set_exception(exc)
                if isinstance(exc, PeerLost):
                    raise

        if call.exclusive:
            self._core.exclusive.append((call.reason, run))
        else:
            run()

    def _pump(self) -> None:
        """Keep intake, cancels and the snapshot moving during a long serial prefill."""
        self._drain_inbox(block=False, defer_calls=True)
        self._publish()

    def _publish(self, state: str | None = None) -> None:
        core = self._core
        if state is None:
            if not core.accepting:
                state = "stopping"
            elif core.loaded is None:
                status = core.model_status
                state = status if status in ("failed", "unloaded") else "starting"
            else:
                state = "ready"
        core.sample_peaks()
        cluster = self._cluster
        if cluster is None:
            self._snapshot = build_snapshot(core, state=state)
            return
        if cluster.state == "peer_lost":
            state = "peer_lost"
        elif cluster.state != "ready":
            state = "starting"
        self._snapshot = build_snapshot(core, state=state, cluster=cluster.view())
