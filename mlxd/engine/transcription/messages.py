"""The values that cross between the HTTP side and a transcription engine's thread (no MLX).

A request carries decoded samples (:mod:`mlxd.engine.audio.decode`) and the
OpenAI form's options (and, streamed, a callback for the text as it
comes), and an event the route sets when its client leaves (the engine stops
before the next window); its outcome is a
:class:`~mlxd.engine.audio.transcript.Transcript` or the engine's
:class:`~mlxd.engine.messages.Failed`, never an exception.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mlxd.engine.audio.transcript import Transcript
from mlxd.engine.messages import Failed


@dataclass(frozen=True)
class TranscriptionJob:
    """One upload to transcribe (``task="transcribe"``) or translate into English."""

    samples: np.ndarray  # float32 mono at 16 kHz
    seconds: float
    task: str = "transcribe"
    language: str | None = None  # None: the model detects it
    prompt: str | None = None
    temperature: float = 0.0
    words: bool = False  # word timestamps asked for
    # stream=true: called on the engine's thread with each new piece of the text
    # (see mlxd.engine.transcription.windows); their concatenation is the text.
    on_text: Callable[[str], None] | None = field(default=None, compare=False)
    # Set by the route when its client has gone: a queued job is skipped, a running
    # one stops before its next window (mlxd.engine.transcription.windows).
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False)


# What a request's future resolves to.
Transcribed = Transcript | Failed
