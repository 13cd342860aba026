"""The chat engine's face: the thread-safe ways to talk to the thread that owns a model.

Everything that touches the model goes through the engine thread
(:mod:`mlxd.engine.chat.engine_thread`): requests (:meth:`Engine.submit`),
cancels (:meth:`Engine.cancel`) and named commands carrying frozen values
(:mod:`mlxd.engine.chat.commands`: :meth:`Engine.load`, :meth:`Engine.apply`,
:meth:`Engine.stop_accepting`, ...), carried out between two steps. Readers
take :meth:`Engine.snapshot`, an immutable value swapped in after every
step, and never wait on the loop. :class:`Engine` implements the fleet's
:class:`~mlxd.engine.model_engine.ModelEngine`.

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
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mlxd.config import Settings
from mlxd.engine.channel import Channel, RequestHandle
from mlxd.engine.chat.commands import (
    AbortAll,
    Apply,
    ClearError,
    Command,
    CountTokens,
    Load,
    Rename,
    StopAccepting,
    Submit,
    Unload,
)
from mlxd.engine.chat.engine_thread import EngineThread
from mlxd.engine.chat.hooks import ClusterHooks, OneMachine
from mlxd.engine.chat.start_deadline import StartDeadline
from mlxd.engine.memory import MemoryPool
from mlxd.engine.messages import Constraint, Failed, GenerationRequest, ModelInfo
from mlxd.engine.snapshot import Snapshot

if TYPE_CHECKING:
    from mlxd.engine.chat.grammar import Grammars


def forget_engine_thread_arrays() -> None:
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
    """Owns one chat model on its own thread; see the module docstring.

    Args:
        settings: The initial settings; the model section says what to load.
        optimized_blas: Whether an optimized CPU BLAS is active (picks the
            demo model's dtype on Linux).
        fault_injection: Honour ``GenerationRequest.fault`` (tests only).
        runtime: Facts about the process (BLAS, device) for the snapshot.
        cluster: What the engine runs on: ``None`` for this machine alone,
            or rank 0's hooks of a cluster
            (:class:`~mlxd.engine.cluster.hooks.LeaderHooks`, docs/cluster.md).
        pool: The memory budget shared with the other loaded models
            (:mod:`mlxd.engine.memory`); ``model_id`` names this engine in it.
        load_at_start: Load the model when the thread starts; otherwise the
            engine waits, unloaded, for :meth:`load` (the fleet's loads).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        optimized_blas: bool = False,
        fault_injection: bool = False,
        runtime: dict[str, Any] | None = None,
        cluster: ClusterHooks | None = None,
        pool: MemoryPool | None = None,
        model_id: str = "",
        load_at_start: bool = True,
    ):
        self.model_id = model_id
        self._thread = EngineThread(
            settings,
            name=model_id,
            hooks=cluster or OneMachine(),
            pool=pool,
            pool_id=model_id,
            optimized_blas=optimized_blas,
            faults=fault_injection,
            runtime=runtime,
            load_at_start=load_at_start,
        )
        self._load_at_start = load_at_start
        thread = self._thread
        self._deadline = StartDeadline(
            settings.server.engine_start_timeout,
            thread.loaded,
            lambda: thread.snapshot.state == "ready",
        )

    # ------------------------------------------------------------ life

    def start(self) -> None:
        """Start the engine thread (it loads the model itself) and the intake thread."""
        self._thread.start()
        if self._load_at_start:
            self._deadline.arm(self._start_overdue)

    def _start_overdue(self, failed: Failed) -> None:
        """The start is late (:mod:`~mlxd.engine.chat.start_deadline`): fail visibly."""
        self._thread.halt(failed)  # every queued request ends with it
        self._thread.snapshot = replace(self._thread.snapshot, state="failed")
        self._thread.loaded.set()  # wait_loaded() returns; load_error says why

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the first model load finished (successfully or not)."""
        return self._thread.loaded.wait(timeout)

    def begin_stop(self) -> None:
        """Ask the engine to stop and return at once; :meth:`stop` then waits.

        The fleet asks every engine first, so they wind down side by side.
        """
        self._deadline.cancel()
        self._thread.stop(timeout=0)  # sets the stop flag, wakes both threads, waits for none

    def stop(self, timeout: float = 10.0, *, forget: bool = True) -> None:
        """Stop the engine: in-flight requests end with an error, the thread exits.

        ``forget=False`` leaves the clean-up of its arrays to the caller
        (:func:`forget_engine_thread_arrays`, once for many engines: it is a
        full garbage collection).
        """
        self.begin_stop()
        if self._thread.stop(timeout) and forget:
            forget_engine_thread_arrays()

    @property
    def alive(self) -> bool:
        return self._thread.alive

    @property
    def busy(self) -> bool:
        """Rows running or queued, as of the latest snapshot."""
        return self._thread.snapshot.busy

    # ------------------------------------------------------------ requests

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; call from a running event loop. Read events from the handle."""
        channel = Channel(asyncio.get_running_loop())
        failure = self._deadline.failure
        if failure is not None:
            channel.push(failure)
        else:
            self._thread.submit(Submit(request, channel))
        return RequestHandle(request.id, channel, self.cancel)

    def cancel(self, request_id: str) -> None:
        """Cancel a request; its row leaves before the next step. Thread-safe."""
        self._thread.cancel(request_id)

    def count_tokens(self, request: GenerationRequest) -> concurrent.futures.Future[int | Failed]:
        """How many prompt tokens ``request`` has, tokenized as at intake.

        The engine thread hands the job to the intake thread with the model
        that serves now, so the count uses the same tokenizer, template and
        thread as a submitted request. A prompt that cannot be tokenized (or
        no model loaded) resolves to a :class:`Failed` value.
        """
        return self.send(CountTokens(request))

    def compile_grammar(self, constraint: Constraint) -> tuple[float, bool] | None:
        """Compile ``constraint`` for the loaded model, so the engine thread finds it cached.

        Blocks (the HTTP side calls it in a worker thread); raises
        ``ValueError`` with the reason when the grammar cannot be compiled or
        accepts no output. Returns ``(seconds, was_cached)``, or None when no
        model (or no grammar support) is loaded; intake then decides.
        """
        grammars = self.grammars
        if grammars is None:
            return None
        return grammars.warm(constraint)

    # ------------------------------------------------------------ commands

    def send(self, command: Command) -> concurrent.futures.Future[Any]:
        """Have the engine thread carry out ``command`` between two steps (thread-safe)."""
        failure = self._deadline.failure
        if failure is None:
            return self._thread.send(command)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_exception(RuntimeError(failure.message))
        return future

    def load(self, settings: Settings) -> concurrent.futures.Future[ModelInfo]:
        """Drain both lanes, load ``settings.model`` and serve it; on failure the old one stays."""
        return self.send(Load(settings.model, settings.speculative))

    def unload(self) -> concurrent.futures.Future[None]:
        """Drain both lanes and drop the model; the thread waits for the next :meth:`load`."""
        return self.send(Unload())

    def apply(self, settings: Settings) -> concurrent.futures.Future[None]:
        """Take new policy settings between two steps; running rows keep running."""
        return self.send(Apply(settings))

    def stop_accepting(self) -> concurrent.futures.Future[None]:
        """Refuse new requests from the next step on (a graceful shutdown); queued ones run."""
        return self.send(StopAccepting())

    def abort_all(self, message: str) -> concurrent.futures.Future[None]:
        """End every queued and running request with ``message`` (503 shutting_down)."""
        return self.send(AbortAll(message))

    def clear_error(self) -> concurrent.futures.Future[None]:
        """Forget the latest engine error (a good reload clears the status bar's)."""
        return self.send(ClearError())

    def rename(self, model_id: str) -> None:
        """Account under ``model_id`` in the shared pool from the next step on."""
        self.model_id = model_id
        self.send(Rename(model_id))

    # ------------------------------------------------------------ reading

    def snapshot(self) -> Snapshot:
        """The latest immutable view of the engine; never blocks."""
        return self._thread.snapshot

    @property
    def settings(self) -> Settings:
        return self._thread.core.settings

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's facts, or None while no model is loaded."""
        return self._thread.model.info

    @property
    def grammars(self) -> Grammars | None:
        """The loaded model's grammar compiler (no MLX state; thread-safe)."""
        return self._thread.model.grammars

    @property
    def load_error(self) -> str | None:
        """Why the model did not load (after :meth:`wait_loaded`), else None."""
        failure = self._deadline.failure
        if failure is not None:
            return failure.message
        core = self._thread.core
        return core.model_error or "the model did not load" if core.loaded is None else None

    @property
    def weights_bytes(self) -> int:
        info = self.info
        return info.weights_bytes if info is not None else 0
