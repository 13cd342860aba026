"""A transcript in each of OpenAI's response formats (mlxd/engine/audio/transcript.py)."""

from __future__ import annotations

import pytest

from mlxd.engine.audio.transcript import Segment, Transcript, Word, clock, render

T = Transcript(
    text="Hello there. General Kenobi.",
    language="english",
    duration=3725.5,
    segments=(Segment(0.0, 1.25, " Hello there."), Segment(3600.5, 3725.5, " General Kenobi.")),
    words=(Word("Hello", 0.0, 0.5), Word("there", 0.5, 1.25)),
)


def test_json_is_the_text_alone_and_text_is_plain() -> None:
    assert render(T, "json") == ({"text": T.text}, "application/json")
    body, media = render(T, "text")
    assert body == T.text and media.startswith("text/plain")


def test_srt_and_vtt_cues() -> None:
    srt, media = render(T, "srt")
    assert media.startswith("application/x-subrip")
    assert srt == (
        "1\n00:00:00,000 --> 00:00:01,250\nHello there.\n\n"
        "2\n01:00:00,500 --> 01:02:05,500\nGeneral Kenobi.\n\n"
    )
    vtt, media = render(T, "vtt")
    assert isinstance(vtt, str) and media.startswith("text/vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    assert "01:00:00.500 --> 01:02:05.500\nGeneral Kenobi.\n" in vtt
    assert clock(59.9996, ",") == "00:01:00,000"


def test_verbose_json_segments_and_words_by_granularity() -> None:
    body, _ = render(T, "verbose_json")
    assert isinstance(body, dict)
    assert body["task"] == "transcribe" and body["language"] == "english"
    assert [s["id"] for s in body["segments"]] == [0, 1] and "words" not in body
    body, _ = render(T, "verbose_json", ["word"])
    assert isinstance(body, dict)
    assert body["words"][1] == {"word": "there", "start": 0.5, "end": 1.25}
    assert "segments" not in body


def test_a_transcript_without_segments_is_one_cue() -> None:
    srt, _ = render(Transcript("hi", "english", 2.0), "srt")
    assert srt == "1\n00:00:00,000 --> 00:00:02,000\nhi\n\n"
    with pytest.raises(ValueError, match="response_format"):
        render(T, "ndjson")
