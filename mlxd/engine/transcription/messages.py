"""The values that cross between the HTTP side and a transcription engine's thread (no MLX).

A request carries decoded samples (:mod:`mlxd.engine.audio.decode`) and the
OpenAI form's options (and, streamed, a callback for the text as it
comes); its outcome is a
:class:`~mlxd.engine.audio.transcript.Transcript` or the engine's
:class:`~mlxd.engine.messages.Failed`, never an exception.
"""

from __future__ import annotations

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


# What a request's future resolves to.
Transcribed = Transcript | Failed
