"""AudioWorker: one model, one thread, its inbox; the base of both audio engines.

:class:`~mlxd.engine.transcription.engine.TranscriptionEngine` and
:class:`~mlxd.engine.speech.engine.SpeechEngine` are each a
:class:`~mlxd.engine.model_engine.ModelEngine` built the same way: one thread
owns the model (MLX streams are thread-local) and takes from one inbox, in the
order it came, a load, an unload or new settings (by command, a future each)
or a job (one at a time; the others wait). :meth:`AudioWorker.stop` fails what
waits with 503 ``shutting_down``. The snapshot is an
:class:`~mlxd.engine.embeddings.messages.EmbeddingSnapshot` (or a subclass),
replaced whole under a lock, so other threads read it without waiting.

A subclass says what differs: how a model loads (:meth:`AudioWorker._open`),
what a job does (:meth:`AudioWorker._handle`, on the thread, with the counts
``queued``/``running`` already moved) and how a job gets an outcome it failed
with (:meth:`AudioWorker._answer`: a future resolved, a callback called). No
MLX here but what is imported lazily on the thread (the cache release, the
load error type).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from mlxd.config import Settings
from mlxd.engine.embeddings.messages import EmbeddingInfo, EmbeddingSnapshot, EmbeddingState
from mlxd.engine.messages import Failed

InfoT = TypeVar("InfoT", bound=EmbeddingInfo)
InfoT_co = TypeVar("InfoT_co", bound=EmbeddingInfo, covariant=True)
SnapT = TypeVar("SnapT", bound=EmbeddingSnapshot)
JobT = TypeVar("JobT")


class Loaded(Protocol[InfoT_co]):
    """A loaded model, as the worker needs it: its facts."""

    @property
    def info(self) -> InfoT_co: ...


LoadedT = TypeVar("LoadedT", bound=Loaded[Any])


@dataclass
class _Work(Generic[JobT]):
    what: str  # load | unload | apply | job
    future: Future[Any] | None = None
    settings: Settings | None = None
    job: JobT | None = None


class AudioWorker(Generic[LoadedT, InfoT, SnapT, JobT]):
    """One model served by its own thread; see the module docstring."""

    _kind: ClassVar[str]  # "speech", "transcription": in the log's texts
    _tag: ClassVar[str]  # "tts", "stt": in the thread's name
    _logger: ClassVar[logging.Logger]  # the subclass's module's

    def __init__(self, settings: Settings, model_id: str, snapshot: type[SnapT]):
        self.model_id = model_id
        self._settings = settings
        self._inbox: queue.Queue[_Work[JobT] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._snap: SnapT = snapshot(
            id=model_id,
            state="unloaded",
            queued=0,
            running=0,
            requests_served=0,
            requests_failed=0,
            inputs_embedded=0,
            tokens_embedded=0,
            last_batch_size=0,
            batch_limit=1,
            forward_passes=0,
            weights_bytes=0,
        )
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._loaded: LoadedT | None = None
        self._info: InfoT | None = None

    # ------------------------------------------------------------ what a subclass says

    def _open(self, settings: Settings) -> LoadedT:
        """Load ``settings``' model (on the thread); raise to fail the load."""
        raise NotImplementedError

    def _handle(self, job: JobT) -> None:
        """Serve ``job`` (on the thread); an exception fails it with a 500."""
        raise NotImplementedError

    def _answer(self, job: JobT, failed: Failed) -> None:
        """Give ``job`` the outcome ``failed`` (nothing counted)."""
        raise NotImplementedError

    # ------------------------------------------------------------ lifecycle (ModelEngine)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.start() called twice")
        self._thread = threading.Thread(
            target=self._run, name=f"mlxd-{self._tag}-{self.model_id}", daemon=True
        )
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._snap.state == "ready"  # never loads at start (the fleet loads it)

    @property
    def load_error(self) -> str | None:
        return self._snap.load_error

    def load(self, settings: Settings) -> Future[InfoT]:
        return self._put(_Work("load", Future(), settings=settings))

    def unload(self) -> Future[None]:
        return self._put(_Work("unload", Future()))

    def apply(self, settings: Settings) -> Future[None]:
        return self._put(_Work("apply", Future(), settings=settings))

    def rename(self, model_id: str) -> None:
        self.model_id = model_id
        self._update(id=model_id)

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what waits with 503 ``shutting_down`` and end the thread."""
        self._stopping = True
        while True:
            try:
                work = self._inbox.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                self._refuse(work, shutting_down())
        self._inbox.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._update(state="stopped", queued=0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy(self) -> bool:
        snap = self._snap
        return snap.queued > 0 or snap.running > 0

    @property
    def info(self) -> InfoT | None:
        return self._info

    @property
    def weights_bytes(self) -> int:
        return self._info.weights_bytes if self._info is not None else 0

    def snapshot(self) -> SnapT:
        return self._snap

    # ------------------------------------------------------------ requests

    def _enqueue(self, job: JobT) -> None:
        """Queue ``job``; never blocks. A stopping engine answers 503 at once."""
        if self._stopping:
            self._answer(job, shutting_down())
            return
        with self._lock:
            self._snap = replace(self._snap, queued=self._snap.queued + 1)
        self._inbox.put(_Work("job", job=job))

    # ------------------------------------------------------------ the model's thread

    def _run(self) -> None:
        try:
            while (work := self._inbox.get()) is not None:
                try:
                    self._do(work)
                except Exception as exc:  # the thread must never die
                    self._logger.exception(
                        "%s engine %s: %s failed", self._kind, self.model_id, work.what
                    )
                    self._refuse(
                        work, Failed("generation_error", f"{type(exc).__name__}: {exc}", 500)
                    )
        finally:
            self._loaded = self._info = None
            gc.collect()
            _release_cache()

    def _do(self, work: _Work[JobT]) -> None:
        if work.what == "load":
            assert work.settings is not None
            self._load(work.settings, work.future)
        elif work.what == "unload":
            self._loaded = self._info = None
            gc.collect()
            _release_cache()
            self._update(state="unloaded", weights_bytes=0)
            resolve(work.future, None)
        elif work.what == "apply":
            assert work.settings is not None
            self._settings = work.settings
            resolve(work.future, None)
        else:
            assert work.job is not None
            self._serve(work.job)

    def _load(self, settings: Settings, future: Future[Any] | None) -> None:
        from mlxd.engine.chat.loading import ModelLoadError

        previous: EmbeddingState = self._snap.state
        self._update(state="loading")
        try:
            loaded = self._open(settings)
        except Exception as exc:
            message = (
                str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            )
            self._logger.error("%s model %s failed to load: %s", self._kind, self.model_id, message)
            gc.collect()
            _release_cache()
            if self._info is None:
                self._update(state="failed", load_error=message)
            else:
                self._update(state=previous)
            _reject(future, ModelLoadError(message))
            return
        info: InfoT = loaded.info
        self._loaded, self._info, self._settings = loaded, info, settings
        gc.collect()
        _release_cache()
        self._update(state="ready", weights_bytes=info.weights_bytes, load_error=None)
        resolve(future, info)

    def _serve(self, job: JobT) -> None:
        with self._lock:
            self._snap = replace(self._snap, queued=self._snap.queued - 1, running=1)
        try:
            self._handle(job)
        finally:
            self._update(running=0)
            _release_cache()

    # ------------------------------------------------------------ outcomes

    def _put(self, work: _Work[JobT]) -> Future[Any]:
        assert work.future is not None
        if self._stopping:
            _reject(work.future, RuntimeError("the engine stopped"))
        else:
            self._inbox.put(work)
        return work.future

    def _refuse(self, work: _Work[JobT], failed: Failed) -> None:
        if work.job is not None:
            with self._lock:
                self._snap = replace(self._snap, queued=max(self._snap.queued - 1, 0))
            self._fail(work.job, failed)
        else:
            _reject(work.future, RuntimeError(failed.message))

    def _fail(self, job: JobT, failed: Failed) -> None:
        """Count a failed request and give ``job`` its outcome."""
        with self._lock:
            self._snap = replace(self._snap, requests_failed=self._snap.requests_failed + 1)
        self._answer(job, failed)

    def _served(self, tokens: int, passes: int, **more: float) -> None:
        """Count a request served: ``tokens`` made in ``passes``; ``more`` adds to other counts."""
        with self._lock:
            s = self._snap
            added = {name: getattr(s, name) + value for name, value in more.items()}
            self._snap = replace(
                s,
                requests_served=s.requests_served + 1,
                inputs_embedded=s.inputs_embedded + 1,
                tokens_embedded=s.tokens_embedded + tokens,
                forward_passes=s.forward_passes + passes,
                last_batch_size=1,
                **added,
            )

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._snap = replace(self._snap, **changes)


def shutting_down() -> Failed:
    return Failed("shutting_down", "the server is shutting down", 503)


def _release_cache() -> None:
    from mlxd.engine.embeddings.loading import release_cache

    release_cache()


def resolve(future: Future[Any] | None, value: Any) -> None:
    if future is not None:
        with contextlib.suppress(InvalidStateError):
            future.set_result(value)


def _reject(future: Future[Any] | None, error: BaseException) -> None:
    if future is not None:
        with contextlib.suppress(InvalidStateError):
            future.set_exception(error)


__all__ = ["AudioWorker", "Loaded", "resolve", "shutting_down"]
