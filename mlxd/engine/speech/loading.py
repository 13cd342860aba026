"""Load a text-to-speech model through mlx-audio and speak one text (MLX here).

Only the speech engine's thread calls these. A model is whatever
``mlx_audio.tts.load`` builds from the directory (``config.json`` naming an
mlx-audio TTS family, the weights, its tokenizer or voices); its facts become
a :class:`~mlxd.engine.speech.messages.SpeechInfo`. Its voices are what the
model says it has: ``get_supported_speakers()`` (Qwen3-TTS CustomVoice), a
``voices`` table (KittenTTS), else the directory's ``voices/`` files
(Kokoro); a model with none speaks in its one voice and a request's voice is
ignored. ``generate()`` yields one result per segment (mlx-audio splits the
text at newlines, some families at sentences too); each is a piece of the
answer, sent as soon as it is made.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.engine.speech.messages import SpeechInfo

# Families whose generate() honours ``speed`` itself (others get ffmpeg's atempo).
NATIVE_SPEED = frozenset({"kokoro", "kitten_tts", "kitten"})
_VOICE_FILES = (".safetensors", ".pt", ".npy", ".bin")


@dataclass
class LoadedSpeaker:
    model: Any
    info: SpeechInfo


def load_speaker(path: str | None, model_id: str) -> LoadedSpeaker:
    """Load the model at ``path``; raises ModelLoadError naming what is wrong."""
    from mlxd.engine.chat.loading import ModelLoadError

    if not path:
        raise ModelLoadError(f'{model_id}: a kind = "speech" model needs a path')
    directory = Path(path).expanduser()
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{model_id}: {directory} has no config.json (an mlx-audio text-to-speech model dir)"
        )
    config = json.loads(config_file.read_text())
    from mlx.utils import tree_flatten

    try:
        from mlx_audio.tts import load
    except ImportError as exc:
        raise ModelLoadError(
            f"{model_id}: a speech model needs mlx-audio ({exc}): pip install 'mlxd[audio]'"
        ) from None

    try:
        model = load(str(directory))
    except ValueError as exc:  # mlx-audio's "model type not supported"
        raise ModelLoadError(f"{model_id}: mlx-audio cannot load {directory}: {exc}") from None
    arrays: list[Any] = [v for _, v in tree_flatten(model.parameters())]
    family = str(config.get("model_type", "") or getattr(model, "model_type", "") or "")
    takes = _parameters(model)
    info = SpeechInfo(
        id=model_id,
        path=str(directory),
        family=family,
        dimensions=0,
        context_length=0,
        vocab_size=int(config.get("vocab_size", 0) or 0),
        weights_bytes=sum(int(v.nbytes) for v in arrays),
        supports_dimensions=False,
        dtype=str(arrays[0].dtype).removeprefix("mlx.core.") if arrays else "",
        created=int(time.time()),
        sample_rate=int(getattr(model, "sample_rate", 0) or config.get("sample_rate", 24_000)),
        voices=voices_of(model, directory),
        takes_speed=family in NATIVE_SPEED and "speed" in takes,
        takes_instructions="instruct" in takes,
    )
    return LoadedSpeaker(model, info)


def _parameters(model: Any) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(model.generate).parameters)
    except (TypeError, ValueError, AttributeError):
        return frozenset()


def voices_of(model: Any, directory: Path) -> tuple[str, ...]:
    """The voice names ``model`` offers, sorted (empty: one voice, not selectable)."""
    speakers: Any = getattr(model, "get_supported_speakers", None)
    if callable(speakers):
        try:
            listed: Any = speakers()
            names = [str(s) for s in listed or ()]
        except Exception:  # a model that cannot tell
            names = []
        if names:
            return tuple(sorted(names))
    table = getattr(model, "voices", None)
    if isinstance(table, dict) and table:
        return tuple(sorted(str(k) for k in table))
    folder = directory / "voices"
    if folder.is_dir():
        return tuple(sorted({p.stem for p in folder.iterdir() if p.suffix in _VOICE_FILES}))
    return ()


def segments(
    loaded: LoadedSpeaker, text: str, voice: str | None, instructions: str | None, speed: float
) -> Iterator[tuple[np.ndarray, int]]:
    """Each segment's float32 mono samples and the audio tokens it took, as generated."""
    import mlx.core as mx

    info = loaded.info
    kwargs: dict[str, Any] = {"verbose": False}
    if info.voices and voice is not None:
        kwargs["voice"] = voice
    if info.takes_instructions and instructions:
        kwargs["instruct"] = instructions
    if info.takes_speed:
        kwargs["speed"] = speed
    for result in loaded.model.generate(text, **kwargs):
        audio = result.audio
        if isinstance(audio, mx.array):
            audio = np.array(audio.astype(mx.float32))
        samples = np.asarray(audio, dtype=np.float32).reshape(-1)
        yield samples, int(getattr(result, "token_count", 0) or 0)


def input_tokens(loaded: LoadedSpeaker, text: str) -> int:
    """What the model reads of ``text``: the tokens its own text tokenizer makes of it
    (without the model's prompt markers), or its characters for a model without one
    (Kokoro and KittenTTS read phonemes made by a phonemizer, not tokens)."""
    tokenizer = getattr(loaded.model, "tokenizer", None)
    encode: Any = getattr(tokenizer, "encode", None)
    if callable(encode):
        try:
            tokens: Any = encode(text, add_special_tokens=False)
            return len(tokens)
        except Exception:  # a tokenizer of another shape: fall back to characters
            pass
    return len(text)
