"""SpeechEngine: one text-to-speech model, one thread, one text at a time.

The :class:`~mlxd.engine.model_engine.ModelEngine` the fleet drives for a
``kind = "speech"`` entry, shaped like the transcription engine: one thread
owns the model (MLX streams are thread-local) and loads, unloads and speaks
in the order the work came, one text at a time (the others wait in order).
A request's audio is not one value but a stream: :meth:`SpeechEngine.submit`
queues a :class:`~mlxd.engine.speech.messages.SpeechJob` and the thread calls
its ``deliver`` with each event: started (the voice accepted), encoded audio
per generated segment (:class:`~mlxd.engine.audio.encode.Encoder`, on this
thread), then done, or a ``Failed``. :meth:`snapshot` is a
:class:`~mlxd.engine.speech.messages.SpeechSnapshot`, read by ``/stats`` and
``/metrics`` as an embedding model's counts (inputs = texts spoken, tokens =
audio tokens, forward passes = segments) plus the audio seconds made.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxd.config import Settings
from mlxd.engine.messages import Failed
from mlxd.engine.speech.messages import (
    SpeechAudio,
    SpeechDone,
    SpeechInfo,
    SpeechJob,
    SpeechSnapshot,
    SpeechStarted,
)
from mlxd.engine.speech.voices import voice_refusal

if TYPE_CHECKING:
    from mlxd.engine.speech.loading import LoadedSpeaker

logger = logging.getLogger(__name__)


@dataclass
class _Work:
    what: str  # load | unload | apply | job
    future: Future[Any] | None = None
    settings: Settings | None = None
    job: SpeechJob | None = None


class SpeechEngine:
    """A text-to-speech model served by its own thread; see the module docstring."""

    def __init__(self, settings: Settings, model_id: str, **_: Any):
        self.model_id = model_id
        self._settings = settings
        self._inbox: queue.Queue[_Work | None] = queue.Queue()
        self._lock = threading.Lock()
        self._snap = SpeechSnapshot(
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
        self._loaded: LoadedSpeaker | None = None
        self._info: SpeechInfo | None = None

    # ------------------------------------------------------------ lifecycle (ModelEngine)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("SpeechEngine.start() called twice")
        self._thread = threading.Thread(
            target=self._run, name=f"mlxd-tts-{self.model_id}", daemon=True
        )
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._snap.state == "ready"  # never loads at start (the fleet loads it)

    @property
    def load_error(self) -> str | None:
        return self._snap.load_error

    def load(self, settings: Settings) -> Future[SpeechInfo]:
        return self._put(_Work("load", Future(), settings=settings))

    def unload(self) -> Future[None]:
        return self._put(_Work("unload", Future()))

    def apply(self, settings: Settings) -> Future[None]:
        return self._put(_Work("apply", Future(), settings=settings))

    def rename(self, model_id: str) -> None:
        self.model_id = model_id
        self._update(id=model_id)

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what waits with 503 ``shutting_down``; the text under way is cut off."""
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
    def info(self) -> SpeechInfo | None:
        return self._info

    @property
    def weights_bytes(self) -> int:
        return self._info.weights_bytes if self._info is not None else 0

    def snapshot(self) -> SpeechSnapshot:
        return self._snap

    # ------------------------------------------------------------ requests

    def submit(self, job: SpeechJob) -> None:
        """Queue ``job``; never blocks. A stopping engine delivers 503 at once."""
        if self._stopping:
            job.deliver(_shutting_down())
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
                    logger.exception("speech engine %s: %s failed", self.model_id, work.what)
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

    def _load(self, settings: Settings, future: Future[Any] | None) -> None:
        from mlxd.engine.chat.loading import ModelLoadError
        from mlxd.engine.speech.loading import load_speaker

        previous = self._snap.state
        self._update(state="loading")
        try:
            loaded = load_speaker(settings.model.path, self.model_id)
        except Exception as exc:
            message = (
                str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
            )
            logger.error("speech model %s failed to load: %s", self.model_id, message)
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
        job = work.job
        assert job is not None
        with self._lock:
            self._snap = replace(self._snap, queued=self._snap.queued - 1, running=1)
        try:
            self._speak(job)
        finally:
            self._update(running=0)
            _release_cache()

    def _speak(self, job: SpeechJob) -> None:
        from mlxd.engine.audio.encode import Encoder
        from mlxd.engine.speech.loading import segments

        loaded = self._loaded
        if loaded is None:
            self._fail(job, Failed("model_not_loaded", "no speech model is loaded", 503))
            return
        info = loaded.info
        refusal = voice_refusal(job.voice, info.voices, self.model_id)
        if refusal is not None:
            self._fail(job, Failed("invalid_value", refusal, 400, param="voice"))
            return
        if job.cancelled.is_set():
            self._fail(job, Failed("cancelled", "the client went away", 499))
            return
        speed = 1.0 if info.takes_speed else job.speed
        pieces = segments(loaded, job.text, job.voice, job.instructions, job.speed)
        # The first segment before the first byte: a model that cannot speak at all
        # (a missing phonemizer, a broken voice file) still gets an error answer.
        try:
            first = next(pieces, None)
            encoder = Encoder(job.response_format, info.sample_rate, speed)
        except Exception as exc:
            self._fail(job, _cannot_speak(self.model_id, exc))
            return
        job.deliver(SpeechStarted(encoder.out_rate))
        samples = tokens = parts = 0
        try:
            for audio, used in itertools.chain([first] if first is not None else [], pieces):
                samples += audio.size
                tokens += used
                parts += 1
                data = encoder.feed(audio)
                if data:
                    job.deliver(SpeechAudio(data))
                if job.cancelled.is_set():
                    break
            tail = encoder.close()
        except Exception as exc:
            logger.exception("speech failed")
            self._fail(job, Failed("generation_error", f"speech failed: {exc}", 500))
            return
        seconds = samples / info.sample_rate if info.sample_rate else 0.0
        with self._lock:
            s = self._snap
            self._snap = replace(
                s,
                requests_served=s.requests_served + 1,
                inputs_embedded=s.inputs_embedded + 1,
                tokens_embedded=s.tokens_embedded + tokens,
                forward_passes=s.forward_passes + parts,
                last_batch_size=1,
                audio_seconds=s.audio_seconds + seconds,
                characters=s.characters + len(job.text),
            )
        job.deliver(SpeechDone(seconds=seconds, tokens=tokens, tail=tail))

    # ------------------------------------------------------------ outcomes

    def _put(self, work: _Work) -> Future[Any]:
        assert work.future is not None
        if self._stopping:
            _reject(work.future, RuntimeError("the engine stopped"))
        else:
            self._inbox.put(work)
        return work.future

    def _refuse(self, work: _Work, failed: Failed) -> None:
        if work.job is not None:
            with self._lock:
                self._snap = replace(self._snap, queued=max(self._snap.queued - 1, 0))
            self._fail(work.job, failed)
        else:
            _reject(work.future, RuntimeError(failed.message))

    def _fail(self, job: SpeechJob, failed: Failed) -> None:
        with self._lock:
            self._snap = replace(self._snap, requests_failed=self._snap.requests_failed + 1)
        job.deliver(failed)

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._snap = replace(self._snap, **changes)


def _cannot_speak(model_id: str, exc: Exception) -> Failed:
    """A failure before the first segment, as the request's error answer."""
    if isinstance(exc, ImportError):  # a family's own dependency (misaki, phonemizer, ...)
        name = getattr(exc, "name", None) or str(exc)
        return Failed(
            "model_load_failed",
            f"The speech model '{model_id}' needs the Python package '{name}', which is not "
            f"installed: pip install it where mlxd runs ({exc}).",
            503,
        )
    logger.error("speech model %s failed before its first segment", model_id, exc_info=exc)
    return Failed("generation_error", f"speech failed: {type(exc).__name__}: {exc}", 500)


def _shutting_down() -> Failed:
    return Failed("shutting_down", "the server is shutting down", 503)


def _release_cache() -> None:
    from mlxd.engine.embeddings.loading import release_cache

    release_cache()


def _resolve(future: Future[Any] | None, value: Any) -> None:
    if future is not None:
        with contextlib.suppress(InvalidStateError):
            future.set_result(value)


def _reject(future: Future[Any] | None, error: BaseException) -> None:
    if future is not None:
        with contextlib.suppress(InvalidStateError):
            future.set_exception(error)


__all__ = ["SpeechEngine"]
