"""The values that cross between the HTTP side and a speech engine's thread (no MLX).

A request is a :class:`SpeechJob`: the text, the checked options and a
``deliver`` callback the engine thread calls with each event, in order:
:class:`SpeechStarted` (the voice was accepted; the sample rate), then
:class:`SpeechAudio` (encoded bytes) as segments are generated, then one
:class:`SpeechDone`, or a :class:`~mlxd.engine.messages.Failed` at any point
(before :class:`SpeechStarted`, it is the request's error answer). The route
sets ``cancelled`` when its client leaves; the engine stops at the next segment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxd.engine.embeddings.messages import EmbeddingInfo, EmbeddingSnapshot
from mlxd.engine.messages import Failed


@dataclass(frozen=True)
class SpeechInfo(EmbeddingInfo):
    """A loaded speech model's facts (``dimensions``, ``context_length``: 0)."""

    sample_rate: int = 0
    # The voices it has (empty: it has one voice, and a request's voice is ignored).
    voices: tuple[str, ...] = ()
    # Whether its generate() takes these itself (else: speed by ffmpeg's atempo,
    # instructions ignored and said so).
    takes_speed: bool = False
    takes_instructions: bool = False


@dataclass(frozen=True)
class SpeechSnapshot(EmbeddingSnapshot):
    """The embedding engine's counts (inputs = requests, tokens = audio tokens generated,
    forward passes = segments) and the audio made."""

    audio_seconds: float = 0.0
    characters: int = 0
    input_tokens: int = 0  # the texts' tokens (loading.input_tokens: tokens, else characters)


@dataclass(frozen=True)
class SpeechStarted:
    sample_rate: int


@dataclass(frozen=True)
class SpeechAudio:
    data: bytes


@dataclass(frozen=True)
class SpeechDone:
    seconds: float  # audio made (before the speed change)
    tokens: int  # audio tokens the model generated (0 when it does not say)
    tail: bytes = b""  # the encoder's last bytes
    # The text's tokens by the model's own tokenizer, else its characters (loading.input_tokens).
    input_tokens: int = 0


SpeechEvent = SpeechStarted | SpeechAudio | SpeechDone | Failed


@dataclass
class SpeechJob:
    """One text to speak, its options checked by the route."""

    text: str
    deliver: Callable[[SpeechEvent], None]
    voice: str | None = None
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = 1.0
    cancelled: threading.Event = field(default_factory=threading.Event)
