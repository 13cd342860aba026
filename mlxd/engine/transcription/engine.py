"""TranscriptionEngine: one speech-to-text model, one thread, one upload at a time.

The :class:`~mlxd.engine.model_engine.ModelEngine` the fleet drives for a
``kind = "transcription"`` entry, an :class:`~mlxd.engine.audio.worker.AudioWorker`.
One thread owns the model (MLX streams are
thread-local): it loads, unloads and transcribes in the order the work came,
one upload at a time (no batching: Whisper's decode of one 30 s window is
the unit of work; requests queue behind each other). Other threads only
:meth:`~TranscriptionEngine.submit` (a future resolving to a
:class:`~mlxd.engine.audio.transcript.Transcript` or a
:class:`~mlxd.engine.messages.Failed`) and read :meth:`snapshot`, an
:class:`~mlxd.engine.embeddings.messages.EmbeddingSnapshot` whose counts are
uploads (``inputs_embedded``), tokens generated (``tokens_embedded``) and
model calls (``forward_passes``), so ``/stats`` and ``/metrics`` read it as
they read an embedding model's. A job whose ``cancelled`` the route set (its
client left) is skipped if it has not begun, and a Whisper decode stops
before its next 30 s window; either fails it ``cancelled`` (499).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxd.config import Settings
from mlxd.engine.audio.worker import AudioWorker, resolve
from mlxd.engine.embeddings.messages import EmbeddingInfo, EmbeddingSnapshot
from mlxd.engine.messages import Failed
from mlxd.engine.transcription.messages import Transcribed, TranscriptionJob
from mlxd.engine.transcription.windows import Stopped

if TYPE_CHECKING:
    from mlxd.engine.transcription.loading import LoadedTranscriber

logger = logging.getLogger(__name__)


@dataclass
class _Upload:
    """A job in the inbox, with the future its outcome resolves."""

    request: TranscriptionJob
    future: Future[Transcribed]


class TranscriptionEngine(
    AudioWorker["LoadedTranscriber", EmbeddingInfo, EmbeddingSnapshot, _Upload]
):
    """A speech-to-text model served by its own thread; see the module docstring."""

    _kind = "transcription"
    _tag = "stt"
    _logger = logger

    def __init__(self, settings: Settings, model_id: str, **_: Any):
        super().__init__(settings, model_id, EmbeddingSnapshot)

    # ------------------------------------------------------------ requests

    def submit(self, job: TranscriptionJob) -> Future[Transcribed]:
        """Queue ``job``; never blocks. A stopping or unloaded engine answers 503."""
        future: Future[Transcribed] = Future()
        future.set_running_or_notify_cancel()
        self._enqueue(_Upload(job, future))
        return future

    # ------------------------------------------------------------ the model's thread

    def _open(self, settings: Settings) -> LoadedTranscriber:
        from mlxd.engine.transcription.loading import load_transcriber

        return load_transcriber(settings.model.path, self.model_id)

    def _answer(self, job: _Upload, failed: Failed) -> None:
        resolve(job.future, failed)

    def _fail(self, job: _Upload, failed: Failed) -> None:
        if not job.future.done():  # answered already: not counted twice
            super()._fail(job, failed)

    def _handle(self, job: _Upload) -> None:
        from mlxd.engine.transcription.loading import refusal, transcribe

        loaded = self._loaded
        if loaded is None:
            self._fail(job, Failed("model_not_loaded", "no transcription model is loaded", 503))
            return
        refused = refusal(loaded, job.request)
        if refused is not None:
            param, message = refused
            self._fail(job, Failed("invalid_value", message, 400, param=param))
            return
        if job.request.cancelled.is_set():  # its client left while it waited
            self._fail(job, _gone())
            return
        try:
            transcript, tokens = transcribe(loaded, job.request)
        except Stopped:
            self._fail(job, _gone())
            return
        except Exception as exc:
            logger.exception("transcription failed")
            message = f"transcription failed: {type(exc).__name__}: {exc}"
            self._fail(job, Failed("generation_error", message, 500))
            return
        self._served(tokens, 1)
        resolve(job.future, transcript)


def _gone() -> Failed:
    return Failed("cancelled", "the client went away", 499)


__all__ = ["TranscriptionEngine"]
