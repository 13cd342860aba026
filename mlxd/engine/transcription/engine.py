"""TranscriptionEngine: one speech-to-text model, one thread, one upload at a time.

The :class:`~mlxd.engine.model_engine.ModelEngine` the fleet drives for a
``kind = "transcription"`` entry. One thread owns the model (MLX streams are
thread-local): it loads, unloads and transcribes in the order the work came,
one upload at a time (no batching: Whisper's decode of one 30 s window is
the unit of work; requests queue behind each other). Other threads only
:meth:`~TranscriptionEngine.submit` (a future resolving to a
:class:`~mlxd.engine.audio.transcript.Transcript` or a
:class:`~mlxd.engine.messages.Failed`) and read :meth:`snapshot`, an
:class:`~mlxd.engine.embeddings.messages.EmbeddingSnapshot` whose counts are
uploads (``inputs_embedded``), tokens generated (``tokens_embedded``) and
model calls (``forward_passes``), so ``/stats`` and ``/metrics`` read it as
they read an embedding model's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxd.config import Settings
from mlxd.engine.embeddings.messages import EmbeddingInfo, EmbeddingSnapshot, EmbeddingState
from mlxd.engine.messages import Failed
from mlxd.engine.transcription.messages import Transcribed, TranscriptionJob

if TYPE_CHECKING:
    from mlxd.engine.transcription.loading import LoadedTranscriber

logger = logging.getLogger(__name__)


@dataclass
class _Work:
    what: str  # load | unload | apply | job
    future: Future[Any]
    settings: Settings | None = None
    job: TranscriptionJob | None = None


class TranscriptionEngine:
    """A speech-to-text model served by its own thread; see the module docstring."""

    def __init__(self, settings: Settings, model_id: str, **_: Any):
        self.model_id = model_id
        self._settings = settings
        self._inbox: queue.Queue[_Work | None] = queue.Queue()
        self._lock = threading.Lock()
        self._snap = EmbeddingSnapshot(
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
        self._loaded: LoadedTranscriber | None = None
        self._info: EmbeddingInfo | None = None

    # ------------------------------------------------------------ lifecycle (ModelEngine)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("TranscriptionEngine.start() called twice")
        self._thread = threading.Thread(
            target=self._run, name=f"mlxd-stt-{self.model_id}", daemon=True
        )
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._snap.state == "ready"  # never loads at start (the fleet loads it)

    @property
    def load_error(self) -> str | None:
        return self._snap.load_error

    def load(self, settings: Settings) -> Future[EmbeddingInfo]:
        return self._put(_Work("load", Future(), settings=settings))

    def unload(self) -> Future[None]:
        return self._put(_Work("unload", Future()))

    def apply(self, settings: Settings) -> Future[None]:
        return self._put(_Work("apply", Future(), settings=settings))

    def rename(self, model_id: str) -> None:
        self.model_id = model_id
        self._update(id=model_id)

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what waits with 503 ``shutting_down``; the upload under way finishes."""
        self._stopping = True
        while True:
            try:
                work = self._inbox.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                self._refuse(work, _shutting_down())
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
    def info(self) -> EmbeddingInfo | None:
        return self._info

    @property
    def weights_bytes(self) -> int:
        return self._info.weights_bytes if self._info is not None else 0

    def snapshot(self) -> EmbeddingSnapshot:
        return self._snap

    # ------------------------------------------------------------ requests

    def submit(self, job: TranscriptionJob) -> Future[Transcribed]:
        """Queue ``job``; never blocks. A stopping or unloaded engine answers 503."""
        future: Future[Transcribed] = Future()
        future.set_running_or_notify_cancel()
        if self._stopping:
            _resolve(future, _shutting_down())
            return future
        with self._lock:
            self._snap = replace(self._snap, queued=self._snap.queued + 1)
        self._inbox.put(_Work("job", future, job=job))
        return future

    # ------------------------------------------------------------ the model's thread

    def _run(self) -> None:
        try:
            while (work := self._inbox.get()) is not None:
                try:
                    self._do(work)
                except Exception as exc:  # the thread must never die
                    logger.exception("transcription engine %s: %s failed", self.model_id, work.what)
                    self._refuse(
                        work, Failed("generation_error", f"{type(exc).__name__}: {exc}", 500)
                    )
        finally:
            self._loaded = self._info = None
            gc.collect()
            _release_cache()

    def _do(self, work: _Work) -> None:
        if work.what == "load":
            assert work.settings is not None
            self._load(work.settings, work.future)
        elif work.what == "unload":
            self._loaded = self._info = None
            gc.collect()
            _release_cache()
            self._update(state="unloaded", weights_bytes=0)
            _resolve(work.future, None)
        elif work.what == "apply":
            assert work.settings is not None
            self._settings = work.settings
            _resolve(work.future, None)
        else:
            self._serve(work)

    def _load(self, settings: Settings, future: Future[Any]) -> None:
        from mlxd.engine.chat.loading import ModelLoadError
        from mlxd.engine.transcription.loading import load_transcriber

        previous: EmbeddingState = self._snap.state
        self._update(state="loading")
        try:
            loaded = load_transcriber(settings.model.path, self.model_id)
        except Exception as exc:
            message = (
                str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            )
            logger.error("transcription model %s failed to load: %s", self.model_id, message)
            gc.collect()
            _release_cache()
            if self._info is None:
                self._update(state="failed", load_error=message)
            else:
                self._update(state=previous)
            _reject(future, ModelLoadError(message))
            return
        self._loaded, self._info, self._settings = loaded, loaded.info, settings
        gc.collect()
        _release_cache()
        self._update(state="ready", weights_bytes=loaded.info.weights_bytes, load_error=None)
        _resolve(future, loaded.info)

    def _serve(self, work: _Work) -> None:
        from mlxd.engine.transcription.loading import refusal, transcribe

        job = work.job
        assert job is not None
        with self._lock:
            self._snap = replace(self._snap, queued=self._snap.queued - 1, running=1)
        loaded = self._loaded
        try:
            if loaded is None:
                failed = Failed("model_not_loaded", "no transcription model is loaded", 503)
                self._finish(work.future, failed)
                return
            refused = refusal(loaded, job)
            if refused is not None:
                param, message = refused
                failed = Failed("invalid_value", message, 400, param=param)
                self._finish(work.future, failed)
                return
            try:
                transcript, tokens = transcribe(loaded, job)
            except Exception as exc:
                logger.exception("transcription failed")
                message = f"transcription failed: {type(exc).__name__}: {exc}"
                self._finish(work.future, Failed("generation_error", message, 500))
                return
            with self._lock:
                s = self._snap
                self._snap = replace(
                    s,
                    requests_served=s.requests_served + 1,
                    inputs_embedded=s.inputs_embedded + 1,
                    tokens_embedded=s.tokens_embedded + tokens,
                    forward_passes=s.forward_passes + 1,
                    last_batch_size=1,
                )
            _resolve(work.future, transcript)
        finally:
            self._update(running=0)
            _release_cache()

    # ------------------------------------------------------------ outcomes

    def _put(self, work: _Work) -> Future[Any]:
        if self._stopping:
            _reject(work.future, RuntimeError("the engine stopped"))
        else:
            self._inbox.put(work)
        return work.future

    def _refuse(self, work: _Work, failed: Failed) -> None:
        if work.what == "job":
            with self._lock:
                self._snap = replace(self._snap, queued=max(self._snap.queued - 1, 0))
            self._finish(work.future, failed)
        else:
            _reject(work.future, RuntimeError(failed.message))

    def _finish(self, future: Future[Any], failed: Failed) -> None:
        if future.done():
            return
        with self._lock:
            self._snap = replace(self._snap, requests_failed=self._snap.requests_failed + 1)
        _resolve(future, failed)

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._snap = replace(self._snap, **changes)


def _shutting_down() -> Failed:
    return Failed("shutting_down", "the server is shutting down", 503)


def _release_cache() -> None:
    from mlxd.engine.embeddings.loading import release_cache

    release_cache()


def _resolve(future: Future[Any], value: Any) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_result(value)


def _reject(future: Future[Any], error: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


__all__ = ["TranscriptionEngine"]
