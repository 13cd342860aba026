"""The engine: one thread that owns MLX, and the thread-safe ways to talk to it.

Everything that touches the model goes through the engine thread: requests
(``submit``), cancels (``cancel``), and any other work (``call``; with
``exclusive=True`` it first drains both lanes, which is how a model is
swapped). Readers take :meth:`Engine.snapshot`, an immutable value swapped
in after every step, and never wait on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mlxd.config import ModelSettings, Settings
from mlxd.engine.channel import Channel, RequestHandle
from mlxd.engine.core import EngineCore
from mlxd.engine.intake import IntakeError, tokenize
from mlxd.engine.messages import Constraint, Failed, GenerationRequest, ModelInfo
from mlxd.engine.model import ModelLoadError, load_model
from mlxd.engine.snapshot import Snapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")

_IDLE_WAIT_S = 0.5
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
        config_source: The config file, for the snapshot.
        runtime: Facts about the process (BLAS, device) for the snapshot.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        optimized_blas: bool = False,
        fault_injection: bool = False,
        config_source: str | None = None,
        runtime: dict[str, Any] | None = None,
    ):
        self._core = EngineCore(
            settings, faults=fault_injection, config_source=config_source, runtime=runtime
        )
        self._optimized_blas = optimized_blas
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deferred: list[_Call] = []
        self._stop = threading.Event()
        self._loaded_event = threading.Event()
        self._generation = 0
        self._thread = threading.Thread(target=self._run, name="mlxd-engine", daemon=True)
        self._snapshot = self._core.snapshot(state="starting")
        self.model_info: ModelInfo | None = None
        # The loaded model's grammar compiler (no MLX state; thread-safe).
        self.grammars: Any = None

    # ------------------------------------------------------------ public API

    def start(self) -> None:
        """Start the engine thread; it loads the model itself."""
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the first model load finished (successfully or not)."""
        return self._loaded_event.wait(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; call from a running event loop. Read events from the handle."""
        channel = Channel(asyncio.get_running_loop())
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
        """How many prompt tokens ``request`` has, tokenized on the engine thread as at intake.

        A prompt that cannot be tokenized (or no model loaded) resolves to a
        :class:`Failed` value, like a refused submission.
        """

        def count(core: EngineCore) -> int | Failed:
            if core.loaded is None:
                return Failed("model_not_loaded", "No model is loaded yet; see /ready.", 503)
            try:
                return len(tokenize(core.loaded, request))
            except IntakeError as exc:
                return Failed(exc.code, str(exc), 400, param=exc.param)  # type: ignore[arg-type]

        return self.call(count)

    def snapshot(self) -> Snapshot:
        """The latest immutable view of the engine; never blocks."""
        return self._snapshot

    @property
    def settings(self) -> Settings:
        return self._core.settings

    def swap_model(self, model: ModelSettings) -> concurrent.futures.Future[ModelInfo]:
        """Drain both lanes, load ``model`` and serve it; on failure the old model stays."""
        return self.call(lambda core: self._swap(core, model), exclusive=True, reason="model_swap")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine: in-flight requests end with an error, the thread exits."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            _forget_engine_thread_arrays()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        core = self._core
        core.pump = self._pump
        self._load_initial()
        while not self._stop.is_set():
            try:
                self._drain_inbox(block=not core.busy)
                if self._stop.is_set():
                    break
                core.tick()
            except Exception as exc:  # the loop must never die silently
                logger.exception("engine loop error; failing in-flight requests and continuing")
                core.counters.engine_errors += 1
                core.last_error = f"engine loop error: {exc!r}"
                core.abort_all(f"internal engine error: {exc}", code="generation_error", status=500)
                time.sleep(0.05)
            self._publish()
        core.abort_all("the engine stopped", code="shutting_down", status=503)
        for call in self._deferred:
            call.future.set_exception(RuntimeError("the engine stopped"))
        self._publish(state="stopped")
        core.release()
        gc.collect()
        logger.info("engine stopped")

    def _load_initial(self) -> None:
        core = self._core
        try:
            loaded = load_model(
                core.settings.model,
                optimized_blas=self._optimized_blas,
                generation=self._generation,
            )
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
        self._publish()

    def _swap(self, core: EngineCore, model: ModelSettings) -> ModelInfo:
        previous_status = core.model_status
        core.model_status = "swapping"
        self._publish()
        self._generation += 1
        try:
            loaded = load_model(
                model, optimized_blas=self._optimized_blas, generation=self._generation
            )
        except Exception as exc:
            core.model_status = previous_status if core.loaded is not None else "failed"
            core.last_error = f"model swap failed: {exc}"
            raise
        core.install_model(loaded)
        core.retokenize_queued()
        self.grammars = loaded.grammars
        self.model_info = loaded.info
        gc.collect()
        import mlx.core as mx

        mx.clear_cache()
        return loaded.info

    def _drain_inbox(self, *, block: bool, defer_calls: bool = False) -> None:
        try:
            first = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            first = None
        messages = [first] if first is not None else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if block and isinstance(first, _Submit):
            messages += self._burst()
        if not defer_calls and self._deferred:
            messages = [*self._deferred, *messages]
            self._deferred = []
        for message in messages:
            if message is None:
                continue
            if isinstance(message, _Submit):
                self._core.intake(message.request, message.channel)
            elif isinstance(message, _Cancel):
                self._core.cancel(message.request_id)
            elif defer_calls:
                self._deferred.append(message)
            else:
                self._dispatch(message)

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
                state = "failed" if core.model_status == "failed" else "starting"
            else:
                state = "ready"
        self._snapshot = core.snapshot(state=state)
