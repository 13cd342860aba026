"""SpeechEngine: one text-to-speech model, one thread, one text at a time.

The :class:`~mlxd.engine.model_engine.ModelEngine` the fleet drives for a
``kind = "speech"`` entry, an :class:`~mlxd.engine.audio.worker.AudioWorker`
like the transcription engine: one thread owns the model (MLX streams are
thread-local) and loads, unloads and speaks in the order the work came, one
text at a time (the others wait in order).
A request's audio is not one value but a stream: :meth:`SpeechEngine.submit`
queues a :class:`~mlxd.engine.speech.messages.SpeechJob` and the thread calls
its ``deliver`` with each event: started (the voice accepted), encoded audio
per generated segment (:class:`~mlxd.engine.audio.encode.Encoder`, on this
thread), then done, or a ``Failed``. :meth:`snapshot` is a
:class:`~mlxd.engine.speech.messages.SpeechSnapshot`, read by ``/stats`` and
``/metrics`` as an embedding model's counts (inputs = texts spoken, tokens =
audio tokens, forward passes = segments) plus the audio seconds made and the
texts' characters and tokens read.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from mlxd.config import Settings
from mlxd.engine.audio.worker import AudioWorker
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


class SpeechEngine(AudioWorker["LoadedSpeaker", SpeechInfo, SpeechSnapshot, SpeechJob]):
    """A text-to-speech model served by its own thread; see the module docstring."""

    _kind = "speech"
    _tag = "tts"
    _logger = logger

    def __init__(self, settings: Settings, model_id: str, **_: Any):
        super().__init__(settings, model_id, SpeechSnapshot)

    # ------------------------------------------------------------ requests

    def submit(self, job: SpeechJob) -> None:
        """Queue ``job``; never blocks. A stopping engine delivers 503 at once."""
        self._enqueue(job)

    # ------------------------------------------------------------ the model's thread

    def _open(self, settings: Settings) -> LoadedSpeaker:
        from mlxd.engine.speech.loading import load_speaker

        return load_speaker(settings.model.path, self.model_id)

    def _answer(self, job: SpeechJob, failed: Failed) -> None:
        job.deliver(failed)

    def _handle(self, job: SpeechJob) -> None:
        from mlxd.engine.audio.encode import Encoder
        from mlxd.engine.speech.loading import input_tokens, segments

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
        read = input_tokens(loaded, job.text)
        self._served(
            tokens, parts, audio_seconds=seconds, characters=len(job.text), input_tokens=read
        )
        job.deliver(SpeechDone(seconds=seconds, tokens=tokens, tail=tail, input_tokens=read))


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


__all__ = ["SpeechEngine"]
