"""EmbeddingEngine: one embedding model, owned by one thread, batching its requests.

MLX streams are thread-local, so the engine's thread loads the model and
makes every MLX call; other threads only :meth:`~EmbeddingEngine.submit`
(a ``concurrent.futures.Future`` comes back) and read
:meth:`~EmbeddingEngine.snapshot`.

The thread works in rounds. A round takes queued requests in arrival order
until it holds at least ``[batch] size`` inputs (always at least one
request), tokenizes them, sorts all their inputs by length (less padding) and
runs forward passes of at most ``size`` inputs and at most
:data:`PASS_TOKENS` padded tokens each, so several requests share one pass.
A request's future resolves as soon as its last input is embedded; what
arrives meanwhile waits for the next round.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxd.config import Settings
from mlxd.engine.embedding_checks import check_inputs, too_long
from mlxd.engine.embedding_messages import (
    EmbeddingError,
    EmbeddingInfo,
    EmbeddingResult,
    EmbeddingSnapshot,
    EmbeddingState,
)

logger = logging.getLogger(__name__)

# Padded tokens (inputs x longest input) one forward pass may hold, beyond a
# single input: attention memory grows with the square of the length, so long
# inputs go in narrower passes.
PASS_TOKENS = 16384


@dataclass
class _Job:
    """One request inside the engine."""

    inputs: list[Any]
    dimensions: int | None
    future: Future
    ids: list[list[int]] = field(default_factory=list)
    vectors: np.ndarray | None = None
    left: int = 0


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
        settings: The model's settings (``settings.for_model(id)``): the
            model's ``path`` and ``max_context``, its ``[batch] size`` (most
            inputs per forward pass, read before every round, so a live change
            applies at the next round).
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
        self._inbox: deque[_Job] = deque()
        self._state: EmbeddingState = "loading"
        self._stopping = False
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None
        self._counts = _Counters()
        self._loaded_model: Any = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the thread; it loads the model, then serves the queue."""
        if self._thread is not None:
            raise RuntimeError("EmbeddingEngine.start() called twice")
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
        """Requests queued or being embedded."""
        with self._cond:
            return bool(self._inbox) or self._counts.running > 0

    @property
    def state(self) -> EmbeddingState:
        return self._state

    def apply(self, settings: Settings) -> None:
        """New settings for this model (a live reload); used from the next round on."""
        self.settings = settings

    def stop(self, timeout: float = 10.0) -> None:
        """Fail queued requests with 503 ``shutting_down``, stop the thread and join it.

        A forward pass under way finishes; the requests of its round that still
        have inputs left fail with ``shutting_down`` too.
        """
        with self._cond:
            self._stopping = True
            queued = list(self._inbox)
            self._inbox.clear()
            self._cond.notify_all()
        for job in queued:
            self._fail(job, _shutting_down())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if not self._thread.is_alive():
                from mlxd.engine.engine import _forget_engine_thread_arrays

                _forget_engine_thread_arrays()
        if not self.alive and self._state != "failed":
            self._state = "stopped"

    # ------------------------------------------------------------ requests

    def submit(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], *, dimensions: int | None = None
    ) -> Future:
        """Queue ``inputs`` (all strings, or all token-id lists) for embedding.

        Returns a future resolving to an :class:`EmbeddingResult` (vectors in
        input order, unit length, truncated to ``dimensions`` and renormalized
        when given), or failing with :class:`EmbeddingError`: 400 for inputs
        the model cannot take, 503 when the engine is stopping or its load
        failed. Never blocks on the model.
        """
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            job = _Job(_copy_inputs(inputs), dimensions, future)
        except EmbeddingError as exc:
            future.set_exception(exc)
            return future
        info = self.info
        if info is not None:
            try:
                check_inputs(job.inputs, info, dimensions)
            except EmbeddingError as exc:
                future.set_exception(exc)
                self._count_failed()
                return future
        with self._cond:
            refusal = self._refusal()
            if refusal is None:
                self._inbox.append(job)
                self._cond.notify()
        if refusal is not None:
            self._fail(job, refusal)
        return future

    def snapshot(self) -> EmbeddingSnapshot:
        """This engine now (counts are read under the queue's lock; never waits on MLX)."""
        with self._cond:
            c = self._counts
            return EmbeddingSnapshot(
                id=self.model_id,
                state=self._state,
                queued=len(self._inbox),
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

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        from mlxd.engine.embedding_model import load_embedding
        from mlxd.engine.model import ModelLoadError

        try:
            loaded = load_embedding(self.settings.model, self.model_id)
        except Exception as exc:
            message = (
                str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            )
            logger.error("embedding model %s failed to load: %s", self.model_id, message)
            self.load_error = message
            self._end_load("failed")
            return
        self._loaded_model = loaded
        self.info = loaded.info
        self.weights_bytes = loaded.info.weights_bytes
        self._end_load("ready")
        try:
            while (jobs := self._take()) is not None:
                self._round(loaded, jobs)
        finally:
            # MLX arrays made on this thread must not outlive it.
            self._loaded_model = loaded = None
            gc.collect()
            with self._cond:
                self._state = "stopped"

    def _end_load(self, state: EmbeddingState) -> None:
        with self._cond:
            self._state = state
            failed = list(self._inbox) if state == "failed" else []
            if failed:
                self._inbox.clear()
        self._loaded.set()
        for job in failed:
            self._fail(job, self._refusal() or _shutting_down())

    def _refusal(self) -> EmbeddingError | None:
        if self._stopping or self._state == "stopped":
            return _shutting_down()
        if self._state == "failed":
            return EmbeddingError(
                503,
                f"The embedding model '{self.model_id}' failed to load: {self.load_error}",
                code="model_load_failed",
            )
        return None

    def _take(self) -> list[_Job] | None:
        """Wait for requests; take them in order until the round holds a batch's inputs."""
        with self._cond:
            while not self._inbox and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            limit = self.settings.batch.size
            jobs = [self._inbox.popleft()]
            count = len(jobs[0].inputs)
            while self._inbox and count + len(self._inbox[0].inputs) <= limit:
                count += len(self._inbox[0].inputs)
                jobs.append(self._inbox.popleft())
            self._counts.running = len(jobs)
            return jobs

    def _round(self, loaded: Any, jobs: list[_Job]) -> None:
        from mlxd.engine.embedding_model import run_pass

        items = [item for job in jobs for item in self._prepare(loaded, job)]
        items.sort(key=lambda item: len(item[0].ids[item[1]]))
        limit = max(1, self.settings.batch.size)
        start = 0
        while start < len(items):
            if self._stopping:
                for job in {id(j): j for j, _ in items[start:]}.values():
                    self._fail(job, _shutting_down())
                break
            end = start + 1
            while end < len(items) and end - start < limit:
                width = len(items[end][0].ids[items[end][1]])
                if (end - start + 1) * width > PASS_TOKENS:
                    break
                end += 1
            chunk = items[start:end]
            start = end
            rows = [job.ids[i] for job, i in chunk]
            try:
                vectors = run_pass(loaded.model, rows, loaded.pad_id)
            except Exception as exc:
                logger.exception("embedding pass of %d inputs failed", len(rows))
                error = EmbeddingError(
                    500,
                    f"the embedding pass failed: {type(exc).__name__}: {exc}",
                    code="embedding_error",
                )
                for job in {id(j): j for j, _ in chunk}.values():
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

    def _prepare(self, loaded: Any, job: _Job) -> list[tuple[_Job, int]]:
        """Check and tokenize ``job``; its (job, input index) items, or none if it failed."""
        from mlxd.engine.embedding_model import tokenize

        info: EmbeddingInfo = loaded.info
        try:
            check_inputs(job.inputs, info, job.dimensions)
            if isinstance(job.inputs[0], str):
                job.ids = tokenize(loaded.tokenizer, job.inputs)
            else:
                job.ids = job.inputs
            for index, ids in enumerate(job.ids):
                if len(ids) > info.context_length:
                    raise too_long(index, f"{len(ids)} tokens", info.context_length)
        except EmbeddingError as exc:
            self._fail(job, exc)
            return []
        except Exception as exc:
            logger.exception("tokenizing an embedding request failed")
            self._fail(
                job, EmbeddingError(500, f"tokenizing failed: {exc}", code="embedding_error")
            )
            return []
        job.vectors = np.zeros((len(job.ids), info.dimensions), dtype=np.float32)
        job.left = len(job.ids)
        return [(job, i) for i in range(len(job.ids))]

    def _finish(self, job: _Job) -> None:
        from mlxd.engine.embedding_model import normalize

        vectors = job.vectors
        assert vectors is not None
        if job.dimensions is not None and job.dimensions < vectors.shape[1]:
            vectors = normalize(vectors[:, : job.dimensions])
        tokens = sum(len(ids) for ids in job.ids)
        with self._cond:
            self._counts.served += 1
            self._counts.inputs += len(job.ids)
            self._counts.tokens += tokens
        if not job.future.done():
            job.future.set_result(EmbeddingResult(vectors=vectors, prompt_tokens=tokens))

    def _fail(self, job: _Job, error: EmbeddingError) -> None:
        if job.future.done():
            return
        self._count_failed()
        job.future.set_exception(error)

    def _count_failed(self) -> None:
        with self._cond:
            self._counts.failed += 1


def _shutting_down() -> EmbeddingError:
    return EmbeddingError(503, "The server is shutting down; retry later.", code="shutting_down")


def _copy_inputs(inputs: Any) -> list[Any]:
    """A private copy of ``inputs`` (a caller may reuse its lists), shape-checked."""
    if isinstance(inputs, str) or not isinstance(inputs, Sequence):
        raise EmbeddingError(
            400,
            "inputs must be a list of strings or of token-id lists",
            code="invalid_value",
            param="input",
        )
    out: list[Any] = []
    for item in inputs:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            out.append([int(t) for t in item])
        else:
            raise EmbeddingError(
                400,
                "each input must be a string or a list of integer token ids",
                code="invalid_value",
                param="input",
            )
    return out
