"""A transcript in OpenAI's ``response_format``s: json, text, srt, vtt, verbose_json (pure).

The rendering half of speech-to-text (issue 37; the route and engine are not
built yet). ``json`` is ``{"text": ...}``, OpenAI's default (mlx-audio's own
server answers ``ndjson`` by default, which OpenAI clients cannot read);
``verbose_json`` carries the task, language, duration and segments, and
``words`` only when ``timestamp_granularities`` asks for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 0.0
    temperature: float = 0.0


@dataclass(frozen=True)
class Word:
    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Transcript:
    text: str
    language: str
    duration: float
    task: str = "transcribe"
    segments: tuple[Segment, ...] = ()
    words: tuple[Word, ...] = field(default_factory=tuple)


def clock(seconds: float, sep: str) -> str:
    """``HH:MM:SS<sep>mmm`` (``,`` for SRT, ``.`` for WebVTT)."""
    ms = max(round(seconds * 1000), 0)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{sep}{ms:03d}"


def _cues(transcript: Transcript) -> list[Segment]:
    if transcript.segments:
        return list(transcript.segments)
    return [Segment(0.0, transcript.duration, transcript.text)]


def srt(transcript: Transcript) -> str:
    return "".join(
        f"{n}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text.strip()}\n\n"
        for n, s in enumerate(_cues(transcript), start=1)
    )


def vtt(transcript: Transcript) -> str:
    cues = "".join(
        f"{clock(s.start, '.')} --> {clock(s.end, '.')}\n{s.text.strip()}\n\n"
        for s in _cues(transcript)
    )
    return "WEBVTT\n\n" + cues


def verbose(transcript: Transcript, granularities: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "task": transcript.task,
        "language": transcript.language,
        "duration": round(transcript.duration, 3),
        "text": transcript.text,
    }
    if "segment" in granularities or not granularities:
        out["segments"] = [
            {
                "id": i,
                "seek": 0,
                "start": round(s.start, 3),
                "end": round(s.end, 3),
                "text": s.text,
                "tokens": list(s.tokens),
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for i, s in enumerate(transcript.segments)
        ]
    if "word" in granularities:
        out["words"] = [
            {"word": w.word, "start": round(w.start, 3), "end": round(w.end, 3)}
            for w in transcript.words
        ]
    return out


def render(
    transcript: Transcript, response_format: str, granularities: Sequence[str] = ()
) -> tuple[str | dict[str, Any], str]:
    """The body and its media type for ``response_format`` (one of :data:`FORMATS`)."""
    if response_format == "json":
        return {"text": transcript.text}, "application/json"
    if response_format == "verbose_json":
        return verbose(transcript, granularities), "application/json"
    if response_format == "text":
        return transcript.text, "text/plain; charset=utf-8"
    if response_format == "srt":
        return srt(transcript), "application/x-subrip; charset=utf-8"
    if response_format == "vtt":
        return vtt(transcript), "text/vtt; charset=utf-8"
    raise ValueError(f"response_format must be one of {', '.join(FORMATS)}")
