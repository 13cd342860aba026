"""Parakeet (NeMo's TDT/RNN-T/CTC speech models, through mlx-audio) as a transcription model.

A Parakeet directory is NeMo's config as ``config.json`` (``target`` names the
NeMo class; ``model_type`` is often absent) and its weights; mlx-audio's
``parakeet`` module builds it. It transcribes (English for the v2 models,
European languages detected by itself for v3) with greedy decoding and
token timestamps, and nothing else Whisper takes: a translation, a
``prompt`` or a ``temperature`` above 0 is refused before it runs
(:func:`refusal`); ``language`` is a hint it does not use. Its
sentences become the transcript's segments and its sub-word tokens, joined at
the word marks, the words (:func:`transcribe_parakeet`). Only the
transcription engine's thread runs these (MLX here).
"""

from __future__ import annotations

from typing import Any

from mlxd.engine.audio.transcript import Segment, Transcript, Word
from mlxd.engine.transcription.messages import TranscriptionJob

_TYPES = frozenset({"parakeet", "parakeet_tdt"})


def is_parakeet(config: dict[str, Any]) -> bool:
    """A Parakeet model's config: its ``model_type``, or NeMo's ASR ``target``."""
    if str(config.get("model_type", "")) in _TYPES:
        return True
    return str(config.get("target", "")).startswith("nemo.collections.asr.models.")


def refusal(model_id: str, job: TranscriptionJob) -> tuple[str, str] | None:
    """What Parakeet cannot do of ``job``: (the form field, the message), else None."""
    if job.task == "translate":
        return "model", (
            f"'{model_id}' is a Parakeet model: it transcribes but does not translate; "
            "use /v1/audio/transcriptions, or a Whisper model for translations."
        )
    if job.prompt:
        return "prompt", (
            f"'{model_id}' is a Parakeet model: it takes no 'prompt' (only Whisper models do)."
        )
    if job.temperature > 0:
        return "temperature", (
            f"'{model_id}' is a Parakeet model: it decodes greedily; "
            "leave 'temperature' out or send 0."
        )
    return None


def words_of(tokens: list[Any]) -> tuple[Word, ...]:
    """Sub-word tokens (``text`` starting with a space at a word's start) as timed words."""
    words: list[Word] = []
    for token in tokens:
        text = str(token.text)
        start, end = float(token.start), float(token.end)
        if words and not text.startswith(" "):
            last = words[-1]
            words[-1] = Word(last.word + text, last.start, end)
        elif text.strip():
            words.append(Word(text.strip(), start, end))
    return tuple(words)


def transcribe_parakeet(model: Any, audio: Any, job: TranscriptionJob) -> tuple[Transcript, int]:
    """Run ``job`` on ``model`` (an mlx-audio Parakeet); the transcript and its token count."""
    out = model.generate(audio)
    sentences = list(getattr(out, "sentences", None) or [])
    segments = tuple(
        Segment(
            start=min(float(s.start), job.seconds),
            end=min(float(s.end), job.seconds),  # a last token's duration may run past the end
            text=str(s.text),
            tokens=tuple(int(t.id) for t in s.tokens),
        )
        for s in sentences
    )
    tokens = [t for s in sentences for t in s.tokens]
    transcript = Transcript(
        text=str(out.text).strip(),
        language=job.language or "",
        duration=job.seconds,
        task=job.task,
        segments=segments,
        words=words_of(tokens) if job.words else (),
    )
    return transcript, len(tokens)


__all__ = ["is_parakeet", "refusal", "transcribe_parakeet", "words_of"]
