"""EmbeddingEngine: one embedding model, owned by one thread, batching its requests.

MLX streams are thread-local, so the engine's thread loads the model and makes every
MLX call. Like the chat engine, the thread lives as long as the model's registry entry
and loads and unloads by command (:meth:`~EmbeddingEngine.load`, ``unload``, ``apply``:
the :class:`~mlxd.engine.model_engine.ModelEngine` protocol the fleet drives).
Other threads only :meth:`~EmbeddingEngine.submit` (a ``concurrent.futures.Future``
comes back and resolves to an :class:`~mlxd.engine.embeddings.messages.EmbeddingResult` or a
:class:`~mlxd.engine.messages.Failed` value, never to an exception) and read
:meth:`~EmbeddingEngine.snapshot`.

A request is checked and tokenized on one of two intake threads (no MLX there; the
Rust tokenizer releases the GIL), so a big text delays only itself while the model's
thread keeps embedding what is ready. The model's thread works in rounds: it takes
prepared requests in arrival order until the round holds at least ``[batch] size``
inputs (always at least one request), sorts all their inputs by length and runs
forward passes of at most ``size`` inputs and
:data:`~mlxd.engine.embeddings.jobs.PASS_TOKENS` padded tokens each, so several
requests share one pass. A request's future resolves as soon as its last input is
embedded. A load or an unload waits for the requests before it; requests that come
meanwhile wait for it (:mod:`mlxd.engine.embeddings.queue`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from mlxd.config import Settings
from mlxd.engine.embeddings.checks import check_inputs
from mlxd.engine.embeddings.jobs import (
    Encoder,
    Job,
    copy_inputs,
    prepare,
    result_of,
    shutting_down,
)
from mlxd.engine.embeddings.messages import (
    Embedded,
    EmbeddingError,
    EmbeddingInfo,
    EmbeddingSnapshot,
    EmbeddingState,
)
from mlxd.engine.embeddings.queue import Apply, Load, Unload, WorkQueue
from mlxd.engine.embeddings.rounds import run_round
from mlxd.engine.messages import Failed

if TYPE_CHECKING:
    from mlxd.engine.embeddings.loading import LoadedEmbedding

logger = logging.getLogger(__name__)

INTAKE_THREADS = 2

T = TypeVar("T")


class EmbeddingEngine:
    """An embedding model served by its own thread.

    Args:
        settings: The model's settings (``for_model(settings, id)``): the
            model's ``path`` and ``max_context``, its ``[batch] size`` (most
            inputs per forward pass; a new value from :meth:`apply` takes
            effect at the next round).
        model_id: The id the model is served under.
        optimized_blas: Accepted for symmetry with the chat engine; embedding
            models load their weights as stored.
        load_at_start: Load ``settings``' model when the thread starts (then
            :meth:`wait_loaded`); otherwise the engine waits, unloaded, for
            :meth:`load` (the fleet's loads).
    """

    def __init__(
        self,
        settings: Settings,
        model_id: str,
        *,
        optimized_blas: bool = False,
        load_at_start: bool = False,
    ):
        self.model_id = model_id
        self.optimized_blas = optimized_blas
        self._load_at_start = load_at_start
        state: EmbeddingState = "loading" if load_at_start else "unloaded"
        self._queue = WorkQueue(model_id, state, settings.batch.size)
        self._first_load = threading.Event()
        self._thread: threading.Thread | None = None
        self._intake: ThreadPoolExecutor | None = None
        # Only the model's thread writes these; the model itself stays on it.
        self._settings = settings
        self._model: LoadedEmbedding | None = None
        self._info: EmbeddingInfo | None = None
        self._encode: Encoder | None = None

    # ------------------------------------------------------------ lifecycle (ModelEngine)

    def start(self) -> None:
        """Start the threads; the model's thread loads now only with ``load_at_start``."""
        if self._thread is not None:
            raise RuntimeError("EmbeddingEngine.start() called twice")
        self._intake = ThreadPoolExecutor(
            INTAKE_THREADS, thread_name_prefix=f"mlxd-embed-intake-{self.model_id}"
        )
        self._thread = threading.Thread(
            target=self._run, name=f"mlxd-embed-{self.model_id}", daemon=True
        )
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Wait for the start-up load to end: True when the model is ready, False when the
        load failed (see :attr:`load_error`), the engine stopped, or ``timeout`` passed."""
        self._first_load.wait(timeout)
        return self._queue.state == "ready"

    @property
    def load_error(self) -> str | None:
        """Why the latest load failed (None once a model is loaded)."""
        return self._queue.load_error

    def load(self, settings: Settings) -> Future[EmbeddingInfo]:
        """Load ``settings.model`` once the queued requests are done; requests that come
        meanwhile wait for it. On failure the future fails with the reason (a loaded
        model keeps serving)."""
        future: Future[EmbeddingInfo] = Future()
        return self._command(Load(settings, future), future)

    def unload(self) -> Future[None]:
        """Drop the model once the queued requests are done; the thread stays."""
        future: Future[None] = Future()
        return self._command(Unload(future), future)

    def apply(self, settings: Settings) -> Future[None]:
        """New settings for this model (a live reload); used from the next round on."""
        future: Future[None] = Future()
        return self._command(Apply(settings, future), future)

    def rename(self, model_id: str) -> None:
        """Serve under ``model_id`` from now on (its snapshot and refusals name it)."""
        self.model_id = model_id
        self._queue.rename(model_id)

    def stop(self, timeout: float = 10.0) -> None:
        """Fail queued requests with 503 ``shutting_down``, stop the threads and join.

        A forward pass under way finishes; the requests of its round that still
        have inputs left fail with ``shutting_down`` too.
        """
        jobs, commands = self._queue.stop()
        for job in jobs:
            self._fail(job, shutting_down())
        for command in commands:
            _reject(command.future, RuntimeError("the engine stopped"))
        if self._intake is not None:
            self._intake.shutdown(wait=False, cancel_futures=True)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if not thread.is_alive():
                from mlxd.engine.chat.engine import forget_engine_thread_arrays

                forget_engine_thread_arrays()
        if not self.alive:
            for job in self._queue.settle("stopped"):
                self._fail(job, shutting_down())

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """Requests queued, being tokenized or being embedded."""
        return self._queue.busy

    @property
    def info(self) -> EmbeddingInfo | None:
        """The loaded model's facts, or None while no model is loaded."""
        return self._info

    @property
    def weights_bytes(self) -> int:
        info = self._info
        return info.weights_bytes if info is not None else 0

    def snapshot(self) -> EmbeddingSnapshot:
        """This engine now (counts are read under the queue's lock; never waits on MLX)."""
        return self._queue.snapshot()

    # ------------------------------------------------------------ requests

    def submit(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> Future[Embedded]:
        """Queue ``inputs`` (all strings, or all token-id lists) for embedding.

        Returns a future resolving to an
        :class:`~mlxd.engine.embeddings.messages.EmbeddingResult` (vectors in
        input order, unit length, truncated to ``dimensions`` and renormalized
        when given), or to a :class:`~mlxd.engine.messages.Failed`: 400 for
        inputs the model cannot take, 503 when the engine is stopping, its
        load failed or no model is loaded. Never blocks on the model or the
        tokenizer.
        """
        future: Future[Embedded] = Future()
        future.set_running_or_notify_cancel()
        try:
            job = Job(copy_inputs(inputs), dimensions, future)
            info = self._info
            if info is not None:
                check_inputs(job.inputs, info, dimensions)
        except EmbeddingError as exc:
            self._fail(Job([], dimensions, future), exc.failed)
            return future
        admission = self._queue.admit(job)
        if isinstance(admission, Failed):
            self._fail(job, admission)
        elif admission == "intake":
            self._to_intake(job)
        return future

    # ------------------------------------------------------------ intake

    def _to_intake(self, job: Job) -> None:
        intake = self._intake
        if intake is None:  # admitted only once a model is loaded, so after start()
            self._fail(job, shutting_down())
            return
        try:
            intake.submit(self._prepare, job)
        except RuntimeError:  # the pool shut down in between: stop() fails the job
            self._fail(job, shutting_down())

    def _prepare(self, job: Job) -> None:
        """On an intake thread: check and tokenize ``job``, then hand it to the model.

        The model cannot change meanwhile: a load or an unload waits until no
        request is in intake.
        """
        info, encode = self._info, self._encode
        try:
            if info is None or encode is None:
                raise EmbeddingError(503, "no embedding model is loaded", code="model_not_loaded")
            prepare(job, info, encode)
        except EmbeddingError as exc:
            self._fail(job, exc.failed)
        except Exception as exc:
            logger.exception("tokenizing an embedding request failed")
            self._fail(job, Failed("embedding_error", f"tokenizing failed: {exc}", 500))
        refusal = self._queue.prepared(job)
        if refusal is not None:
            self._fail(job, refusal)

    # ------------------------------------------------------------ the model's thread

    def _run(self) -> None:
        from mlxd.engine.embeddings.loading import release_cache

        try:
            if self._load_at_start:
                self._load(self._settings)
            self._first_load.set()
            while (work := self._queue.next(self._settings.batch.size)) is not None:
                if isinstance(work, Load):
                    self._load(work.settings, work.future)
                elif isinstance(work, Unload):
                    self._unload(work.future)
                elif isinstance(work, Apply):
                    self._settings = work.settings
                    self._queue.set_batch_limit(work.settings.batch.size)
                    _resolve(work.future, None)
                else:
                    self._serve(work)
                    if self._queue.inbox_empty():  # idle: activations need not stay cached
                        release_cache()
        finally:
            # MLX arrays made on this thread must not outlive it.
            self._model = self._info = self._encode = None
            gc.collect()
            release_cache()
            for job in self._queue.settle("stopped"):
                self._fail(job, shutting_down())
            self._first_load.set()

    def _load(self, settings: Settings, future: Future[EmbeddingInfo] | None = None) -> None:
        from mlxd.engine.chat.loading import ModelLoadError
        from mlxd.engine.embeddings.loading import release_cache

        loaded, message = None, ""
        try:
            loaded = self._load_model(settings)
        except Exception as exc:
            message = (
                str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            )
        if loaded is None:
            logger.error("embedding model %s failed to load: %s", self.model_id, message)
            # The exception's frames may have held a half-loaded model: free it on this thread.
            gc.collect()
            release_cache()
            old = self._info
            if old is None:
                waited = self._queue.settle("failed", load_error=message, weights_bytes=0)
            else:  # the loaded model keeps serving
                waited = self._queue.settle("ready", weights_bytes=old.weights_bytes)
            self._release(waited)
            if future is not None:
                _reject(future, ModelLoadError(message))
            return
        self._model, self._encode, self._info = loaded, loaded.encode, loaded.info
        self._settings = settings
        gc.collect()  # a model this one replaced
        release_cache()
        waited = self._queue.settle(
            "ready",
            weights_bytes=loaded.info.weights_bytes,
            batch_limit=settings.batch.size,
            loaded=True,
        )
        self._release(waited)
        if future is not None:
            _resolve(future, loaded.info)

    def _load_model(self, settings: Settings) -> LoadedEmbedding:  # RerankEngine: its own
        from mlxd.engine.embeddings.loading import load_embedding

        return load_embedding(settings.model, self.model_id)

    def _unload(self, future: Future[None]) -> None:
        from mlxd.engine.embeddings.loading import release_cache

        self._model = self._info = self._encode = None
        gc.collect()
        release_cache()
        self._release(self._queue.settle("unloaded", weights_bytes=0))
        _resolve(future, None)

    def _release(self, waited: list[Job]) -> None:
        """Requests that waited for a load: prepared here, in their order, and queued
        together (this thread has nothing else to do yet), or refused."""
        if not waited:
            return
        if self._queue.state != "ready":
            refusal = self._queue.refusal()
            for job in waited:
                self._fail(job, refusal)
            return
        for job in waited:
            self._prepare(job)

    def _serve(self, jobs: list[Job]) -> None:
        """One round; the thread must never die, so a failure fails the round only."""
        loaded = self._model
        assert loaded is not None  # rounds are taken only while a model is ready
        try:
            run_round(
                loaded, jobs, self._settings.batch.size, self._queue, self._finish, self._fail
            )
        except Exception as exc:
            logger.exception("embedding round failed")
            error = Failed("embedding_error", f"embedding failed: {type(exc).__name__}: {exc}", 500)
            for job in jobs:
                self._fail(job, error)
            self._queue.round_ended()

    # ------------------------------------------------------------ outcomes

    def _command(self, command: Load | Unload | Apply, future: Future[T]) -> Future[T]:
        if not self._queue.command(command):
            _reject(future, RuntimeError("the engine stopped"))
        return future

    def _finish(self, job: Job) -> None:
        result = result_of(job)
        self._queue.count_served(len(job.ids), result)
        _resolve(job.future, result)

    def _fail(self, job: Job, failed: Failed) -> None:
        if job.future.done():
            return
        self._queue.count_failed()
        _resolve(job.future, failed)


def _resolve(future: Future[T], value: T) -> None:
    """Set ``future``'s value unless another thread did first (a stop and a round may race)."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(value)


def _reject(future: Future[Any], error: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)
