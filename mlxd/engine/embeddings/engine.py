"""EmbeddingEngine: one embedding model, owned by one thread, batching its requests.

MLX streams are thread-local, so the engine's thread loads the model and
makes every MLX call; other threads only :meth:`~EmbeddingEngine.submit`
(a ``concurrent.futures.Future`` comes back) and read
:meth:`~EmbeddingEngine.snapshot`.

A request is checked and tokenized on one of two intake threads (no MLX
there; the Rust tokenizer releases the GIL), so a big text delays only
itself while the model's thread keeps embedding what is ready. The model's
thread works in rounds: it takes prepared requests in arrival order until
the round holds at least ``[batch] size`` inputs (always at least one
request), sorts all their inputs by length and runs forward passes of at
most ``size`` inputs and :data:`~mlxd.engine.embeddings.jobs.PASS_TOKENS`
padded tokens each, so several requests share one pass. A request's future
resolves as soon as its last input is embedded.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mlxd.config import Settings
from mlxd.engine.embeddings.checks import check_inputs
from mlxd.engine.embeddings.jobs import (
    Job,
    copy_inputs,
    plan_passes,
    prepare,
    result_of,
    shutting_down,
)
from mlxd.engine.embeddings.messages import (
    EmbeddingError,
    EmbeddingInfo,
    EmbeddingSnapshot,
    EmbeddingState,
)

logger = logging.getLogger(__name__)

INTAKE_THREADS = 2


@dataclass
class _Counters:
    served: int = 0
    failed: int = 0
    inputs: int = 0
    tokens: int = 0
    passes: int = 0
    last_batch: int = 0
    running: int = 0


class EmbeddingEngine:
    """An embedding model served by its own thread.

    Args:
        settings: The model's settings (``for_model(settings, id)``): the
            model's ``path`` and ``max_context``, its ``[batch] size`` (most
            inputs per forward pass, read before every round, so a new value
            from :meth:`apply` takes effect at the next round).
        model_id: The id the model is served under.
        optimized_blas: Accepted for symmetry with the chat engine; embedding
            models load their weights as stored.
    """

    def __init__(self, settings: Settings, model_id: str, *, optimized_blas: bool = False):
        self.settings = settings
        self.model_id = model_id
        self.optimized_blas = optimized_blas
        self.info: EmbeddingInfo | None = None
        self.load_error: str | None = None
        self.weights_bytes = 0
        self._cond = threading.Condition()
        self._waiting: list[Job] = []  # submitted before the load ended
        self._intaking: set[Job] = set()  # on an intake thread
        self._inbox: deque[Job] = deque()  # prepared, for the model's thread
        self._state: EmbeddingState = "loading"
        self._stopping = False
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None
        self._intake: ThreadPoolExecutor | None = None
        self._encode: Any = None
        self._counts = _Counters()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the thread; it loads the model, then serves the queue."""
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
        """Wait for the load to end: True when the model is ready, False when the
        load failed (see :attr:`load_error`), the engine stopped, or ``timeout`` passed."""
        self._loaded.wait(timeout)
        return self._state == "ready"

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """Requests queued, being tokenized or being embedded."""
        with self._cond:
            return bool(self._waiting or self._intaking or self._inbox or self._counts.running)

    @property
    def state(self) -> EmbeddingState:
        return self._state

    def apply(self, settings: Settings) -> None:
        """New settings for this model (a live reload); used from the next round on."""
        self.settings = settings

    def stop(self, timeout: float = 10.0) -> None:
        """Fail queued requests with 503 ``shutting_down``, stop the threads and join.

        A forward pass under way finishes; the requests of its round that still
        have inputs left fail with ``shutting_down`` too.
        """
        with self._cond:
            self._stopping = True
            queued = [*self._waiting, *self._intaking, *self._inbox]
            self._waiting.clear()
            self._intaking.clear()
            self._inbox.clear()
            self._cond.notify_all()
        for job in queued:
            self._fail(job, shutting_down())
        if self._intake is not None:
            self._intake.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if not self._thread.is_alive():
                from mlxd.engine.chat.engine import _forget_engine_thread_arrays

                _forget_engine_thread_arrays()
        if not self.alive and self._state != "failed":
            self._state = "stopped"

    # ------------------------------------------------------------ requests

    def submit(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> Future:
        """Queue ``inputs`` (all strings, or all token-id lists) for embedding.

        Returns a future resolving to an
        :class:`~mlxd.engine.embeddings.messages.EmbeddingResult` (vectors in
        input order, unit length, truncated to ``dimensions`` and renormalized
        when given), or failing with :class:`EmbeddingError`: 400 for inputs
        the model cannot take, 503 when the engine is stopping or its load
        failed. Never blocks on the model or the tokenizer.
        """
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            job = Job(copy_inputs(inputs), dimensions, future)
            if self.info is not None:
                check_inputs(job.inputs, self.info, dimensions)
        except EmbeddingError as exc:
            self._fail(Job([], dimensions, future), exc)
            return future
        with self._cond:
            refusal = self._refusal()
            loading = self._state == "loading"
            if refusal is None and loading:
                self._waiting.append(job)
            elif refusal is None:
                self._intaking.add(job)
        if refusal is not None:
            self._fail(job, refusal)
        elif not loading:
            self._to_intake(job)
        return future

    def snapshot(self) -> EmbeddingSnapshot:
        """This engine now (counts are read under the queue's lock; never waits on MLX)."""
        with self._cond:
            c = self._counts
            return EmbeddingSnapshot(
                id=self.model_id,
                state=self._state,
                queued=len(self._waiting) + len(self._intaking) + len(self._inbox),
                running=c.running,
                requests_served=c.served,
                requests_failed=c.failed,
                inputs_embedded=c.inputs,
                tokens_embedded=c.tokens,
                last_batch_size=c.last_batch,
                batch_limit=self.settings.batch.size,
                forward_passes=c.passes,
                weights_bytes=self.weights_bytes,
                load_error=self.load_error,
            )

    # ------------------------------------------------------------ intake

    def _to_intake(self, job: Job) -> None:
        assert self._intake is not None
        try:
            self._intake.submit(self._prepare, job)
        except RuntimeError:  # the pool shut down in between: stop() fails the job
            self._fail(job, shutting_down())

    def _prepare(self, job: Job, *, notify: bool = True) -> None:
        """On an intake thread: check and tokenize ``job``, then hand it to the model."""
        info = self.info
        assert info is not None
        try:
            prepare(job, info, self._encode)
        except EmbeddingError as exc:
            self._fail(job, exc)
        except Exception as exc:
            logger.exception("tokenizing an embedding request failed")
            self._fail(
                job, EmbeddingError(500, f"tokenizing failed: {exc}", code="embedding_error")
            )
        with self._cond:
            self._intaking.discard(job)
            if job.future.done():
                return
            if self._stopping:
                refusal: EmbeddingError | None = shutting_down()
            else:
                refusal = None
                self._inbox.append(job)
                if notify:
                    self._cond.notify()
        if refusal is not None:
            self._fail(job, refusal)

    # ------------------------------------------------------------ the model's thread

    def _run(self) -> None:
        from mlxd.engine.chat.loading import ModelLoadError
        from mlxd.engine.embeddings.loading import load_embedding, release_cache

        loaded, message = None, ""
        try:
            loaded = load_embedding(self.settings.model, self.model_id)
        except Exception as exc:
            message = (
                str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            )
        if loaded is None:
            logger.error("embedding model %s failed to load: %s", self.model_id, message)
            self.load_error = message
            # The exception's frames may have held a half-loaded model: free it on this thread.
            gc.collect()
            release_cache()
            self._end_load("failed")
            return
        self._encode = loaded.encode
        self.info = loaded.info
        self.weights_bytes = loaded.info.weights_bytes
        self._end_load("ready")
        try:
            while (jobs := self._take()) is not None:
                try:
                    self._round(loaded, jobs)
                except Exception as exc:  # the thread must never die: fail the round only
                    logger.exception("embedding round failed")
                    error = EmbeddingError(
                        500,
                        f"embedding failed: {type(exc).__name__}: {exc}",
                        code="embedding_error",
                    )
                    for job in jobs:
                        self._fail(job, error)
                    with self._cond:
                        self._counts.running = 0
                if not self._inbox:  # idle: activations need not stay cached
                    release_cache()
        finally:
            # MLX arrays made on this thread must not outlive it.
            loaded = None
            gc.collect()
            release_cache()
            with self._cond:
                self._state = "stopped"

    def _end_load(self, state: EmbeddingState) -> None:
        """Publish the load's outcome; requests that waited for it are prepared here,
        in their order, and queued together (the thread has nothing else to do yet)."""
        with self._cond:
            if not self._stopping:
                self._state = state
            waiting, self._waiting = self._waiting, []
            ready = state == "ready" and not self._stopping
            if ready:
                self._intaking.update(waiting)
        self._loaded.set()
        if not ready:
            for job in waiting:
                self._fail(job, self._refusal() or shutting_down())
            return
        for job in waiting:
            self._prepare(job, notify=False)
        with self._cond:
            self._cond.notify()

    def _refusal(self) -> EmbeddingError | None:
        if self._stopping or self._state == "stopped":
            return shutting_down()
        if self._state == "failed":
            return EmbeddingError(
                503,
                f"The embedding model '{self.model_id}' failed to load: {self.load_error}",
                code="model_load_failed",
            )
        return None

    def _take(self) -> list[Job] | None:
        """Wait for prepared requests; take them in order until the round holds a batch."""
        with self._cond:
            while not self._inbox and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            limit = self.settings.batch.size
            jobs = [self._inbox.popleft()]
            count = jobs[0].width
            while self._inbox and count + self._inbox[0].width <= limit:
                count += self._inbox[0].width
                jobs.append(self._inbox.popleft())
            self._counts.running = len(jobs)
            return jobs

    def _round(self, loaded: Any, jobs: list[Job]) -> None:
        from mlxd.engine.embeddings.loading import run_pass

        passes = plan_passes(jobs, self.settings.batch.size)
        for n, chunk in enumerate(passes):
            if self._stopping:
                for job in {job for rest in passes[n:] for job, _ in rest}:
                    self._fail(job, shutting_down())
                break
            rows = [job.ids[i] for job, i in chunk]
            try:
                vectors = run_pass(loaded.model, rows, loaded.pad_id)
                if vectors.shape != (len(rows), loaded.info.dimensions):
                    raise ValueError(
                        f"vectors of shape {vectors.shape}, expected "
                        f"{(len(rows), loaded.info.dimensions)}"
                    )
            except Exception as exc:
                logger.exception("embedding pass of %d inputs failed", len(rows))
                error = EmbeddingError(
                    500,
                    f"the embedding pass failed: {type(exc).__name__}: {exc}",
                    code="embedding_error",
                )
                for job in {job for job, _ in chunk}:
                    self._fail(job, error)
                continue
            with self._cond:
                self._counts.passes += 1
                self._counts.last_batch = len(rows)
            for (job, i), vector in zip(chunk, vectors, strict=True):
                if job.future.done():
                    continue
                assert job.vectors is not None
                job.vectors[i] = vector
                job.left -= 1
                if job.left == 0:
                    self._finish(job)
        with self._cond:
            self._counts.running = 0

    def _finish(self, job: Job) -> None:
        result = result_of(job)
        with self._cond:
            self._counts.served += 1
            self._counts.inputs += len(job.ids)
            self._counts.tokens += result.prompt_tokens
        if not job.future.done():
            job.future.set_result(result)

    def _fail(self, job: Job, error: EmbeddingError) -> None:
        if job.future.done():
            return
        with self._cond:
            self._counts.failed += 1
        job.future.set_exception(error)
