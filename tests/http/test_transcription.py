"""``kind = "transcription"`` (issue 37): a tiny random-weight Whisper serves
/v1/audio/transcriptions and /v1/audio/translations through the openai SDK, in each
response_format; bad uploads, an unknown model and a chat model are clear 4xx."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from tests.support.audio import wav16
from tests.support.daemon import toml_config

pytest.importorskip("mlx_audio")


def wav_bytes(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    return wav16(np.sin(np.arange(int(seconds * rate)) / 10) * 8000, rate)


@pytest.fixture(scope="module")
def daemon(apps, tiny_models, tiny_whisper_model):
    from tests.support.tinyparakeet import tiny_parakeet_dir

    models = {
        "chat": {"path": str(tiny_models("llama"))},
        "whisper": {"kind": "transcription", "path": str(tiny_whisper_model)},
        "parakeet": {"kind": "transcription", "path": str(tiny_parakeet_dir())},
    }
    return apps.get(
        toml_config(models=models, limits={"audio_seconds": 3.0, "audio_bytes": "128KiB"})
    )


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return daemon.openai()


def test_sdk_json_default_and_each_format(daemon, client) -> None:
    audio = ("a.wav", wav_bytes())
    raw = client.audio.transcriptions.with_raw_response.create(model="whisper", file=audio)
    default = raw.parse()
    assert isinstance(default.text, str)  # json: {"text": ...}, OpenAI's default
    assert set(json.loads(raw.text)) == {"text"}
    assert raw.headers["content-type"].startswith("application/json")
    text = client.audio.transcriptions.create(model="whisper", file=audio, response_format="text")
    assert isinstance(text, str) and text == default.text
    srt = client.audio.transcriptions.create(model="whisper", file=audio, response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ")
    vtt = client.audio.transcriptions.create(model="whisper", file=audio, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    verbose = client.audio.transcriptions.create(
        model="whisper",
        file=audio,
        response_format="verbose_json",
        language="en",
        timestamp_granularities=["segment", "word"],
    )
    assert verbose.language == "en" and verbose.duration == pytest.approx(1.0)
    assert verbose.segments is not None and verbose.words is not None


def test_translation_and_stream(daemon, client) -> None:
    audio = ("a.wav", wav_bytes(0.5))
    raw = client.audio.translations.with_raw_response.create(
        model="whisper", file=audio, response_format="verbose_json"
    )
    assert isinstance(raw.parse().text, str)
    assert json.loads(raw.text)["task"] == "translate"
    with daemon.client() as http:
        stream = http.post(
            "/v1/audio/transcriptions",
            files={"file": audio},
            data={"model": "whisper", "stream": "true"},
        )
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = [
        json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")
    ]
    assert events[-1]["type"] == "transcript.text.done"
    assert all(e["type"] == "transcript.text.delta" for e in events[:-1])
    models = {m["id"]: m for m in http_json(daemon, "/v1/models")["data"]}
    assert models["whisper"]["kind"] == "transcription"
    assert models["whisper"]["context_length"] == 64  # the tiny decoder's n_text_ctx
    stats = {m["id"]: m for m in http_json(daemon, "/stats")["fleet"]["models"]}
    assert stats["whisper"]["engine"]["requests_served"] >= 2
    with daemon.client() as http:
        metrics = http.get("/metrics").text
    assert 'mlxd_embedding_requests_total{model="whisper",outcome="served"}' in metrics


def test_parakeet_json_verbose_stream_and_what_it_cannot(daemon, client) -> None:
    audio = ("a.wav", wav_bytes())
    plain = client.audio.transcriptions.create(model="parakeet", file=audio)
    assert plain.text and set(plain.text.split()) <= {
        "the",
        "river",
        "boats",
        "rock",
        "gently",
        "hello",
        "world",
        "boat",
    }
    verbose = client.audio.transcriptions.create(
        model="parakeet",
        file=audio,
        response_format="verbose_json",
        timestamp_granularities=["segment", "word"],
    )
    assert verbose.text == plain.text and verbose.duration == pytest.approx(1.0)
    assert verbose.segments and all(0 <= s.start <= s.end <= 1.0 for s in verbose.segments)
    assert verbose.words and " ".join(w.word for w in verbose.words) == plain.text
    events = list(client.audio.transcriptions.create(model="parakeet", file=audio, stream=True))
    assert [e.type for e in events] == ["transcript.text.delta", "transcript.text.done"]
    assert events[0].delta == events[1].text == plain.text
    for call, field in (
        (lambda: client.audio.translations.create(model="parakeet", file=audio), "model"),
        (
            lambda: client.audio.transcriptions.create(model="parakeet", file=audio, prompt="hi"),
            "prompt",
        ),
        (
            lambda: client.audio.transcriptions.create(
                model="parakeet", file=audio, temperature=0.5
            ),
            "temperature",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == field and "Parakeet" in refused.value.message
    models = {m["id"]: m for m in http_json(daemon, "/v1/models")["data"]}
    assert models["parakeet"]["kind"] == "transcription"


def http_json(daemon, path: str):
    with daemon.client() as http:
        return http.get(path).json()


def post(daemon, data: bytes, filename: str = "a.wav", **fields: str):
    with daemon.client() as http:
        return http.post(
            "/v1/audio/transcriptions",
            files={"file": (filename, data)},
            data={"model": "whisper", **fields},
        )


@pytest.mark.parametrize(
    ("data", "fields", "status", "param", "words"),
    [
        (b"this is not audio at all" * 4, {}, 400, "file", "not"),
        (b"", {}, 400, "file", "empty"),
        (wav_bytes(0.0), {}, 400, "file", "no audio samples"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, {}, 400, "file", "not audio"),
        (wav_bytes()[:2000], {}, 400, "file", "truncated"),
        (wav_bytes(4.0), {}, 400, "file", "3 s"),
        (wav_bytes(10.0), {}, 413, None, "limits.audio_bytes"),
        (b"\x00\x00\x00\x20ftypM4A " + b"\x00" * 64, {}, 400, "file", "ffmpeg"),
        (wav_bytes(0.2), {"response_format": "mp3"}, 400, "response_format", "json"),
        (wav_bytes(0.2), {"temperature": "7"}, 400, "temperature", "0 to 1"),
        (wav_bytes(0.2), {"language": "English"}, 400, "language", "ISO-639-1"),
        (wav_bytes(0.2), {"language": "zz"}, 400, "language", "Whisper"),
        (wav_bytes(0.2), {"timestamp_granularities[]": "word"}, 400, None, "verbose_json"),
        (wav_bytes(0.2), {"colour": "red"}, 400, "colour", "Unrecognized"),
        (wav_bytes(0.2), {"model": "nope"}, 404, "model", "nope"),
        (wav_bytes(0.2), {"model": "chat"}, 400, "model", "/v1/chat/completions"),
    ],
)
def test_bad_requests(daemon, data, fields, status, param, words) -> None:
    r = post(daemon, data, **fields)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_the_file_is_told_by_its_bytes_not_its_declared_type(daemon) -> None:
    with daemon.client() as http:
        as_png = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("a.png", wav_bytes(0.2), "image/png")},
            data={"model": "whisper"},
        )
        png_as_wav = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("a.wav", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "audio/wav")},
            data={"model": "whisper"},
        )
    assert as_png.status_code == 200, as_png.text
    assert png_as_wav.status_code == 400 and "not audio" in png_as_wav.json()["error"]["message"]


def test_not_multipart_and_no_file(daemon) -> None:
    with daemon.client() as http:
        as_json = http.post("/v1/audio/transcriptions", json={"model": "whisper"})
        no_file = http.post(
            "/v1/audio/transcriptions", files={"x": ("a", b"1")}, data={"model": "whisper"}
        )
    assert as_json.status_code == 415
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
