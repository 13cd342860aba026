"""``kind = "speech"`` (issue 37): a tiny random-weight Soprano serves /v1/audio/speech
in each response_format (each decoded back as audio of the right length), streamed
in pieces and as OpenAI's SSE events; every bad value a 4xx naming its field."""

from __future__ import annotations

import base64
import io
import json
import logging
import time

import pytest

from tests.support.daemon import toml_config
from tests.support.tinytts import SAMPLE_RATE, SAMPLES_PER_LINE, VOICES

# pcm is OpenAI's 24 kHz: a line's 6144 samples at 32 kHz resampled, 16-bit.
PCM_RATE = 24_000
PCM_LINE = 2 * SAMPLES_PER_LINE * PCM_RATE // SAMPLE_RATE

pytest.importorskip("mlx_audio")
av = pytest.importorskip("av")

MAIN = "sk-main"
TWO_LINES = "Hello there.\nA second line."


@pytest.fixture(scope="module")
def daemon(apps, tiny_models, tiny_tts_model):
    models = {
        "chat": {"path": str(tiny_models("llama"))},
        "voice": {"kind": "speech", "path": str(tiny_tts_model)},
    }
    keys = {
        "main": {"key": MAIN},
        "chat_only": {"key": "sk-chat-only", "models": ["chat"]},
        "one_a_minute": {"key": "sk-one", "requests_per_minute": 1},
        "few_tokens": {"key": "sk-tokens", "tokens_per_minute": 5},
    }
    return apps.get(toml_config(models=models, keys=keys, limits={"speech_chars": 200}))


def speak(daemon, key: str = MAIN, **body):
    with daemon.client(headers={"Authorization": f"Bearer {key}"}) as http:
        return http.post("/v1/audio/speech", json={"model": "voice", **body})


def decoded(data: bytes) -> tuple[int, int, int]:
    """(sample rate, channels, samples) of an encoded answer, read back by PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return stream.rate, stream.channels, samples


def test_each_format_decodes_to_the_pcm_length(daemon) -> None:
    client = daemon.openai(api_key=MAIN)
    raw = client.audio.speech.with_raw_response.create(
        model="voice", voice="af_tiny", input="Hello.", response_format="pcm"
    )
    assert raw.headers["content-type"] == "audio/pcm"
    assert raw.headers["x-mlxd-sample-rate"] == str(PCM_RATE)
    assert "x-mlxd-ignored-parameters" not in raw.headers
    pcm = raw.content
    assert len(pcm) == PCM_LINE  # 16-bit mono
    seconds = len(pcm) / 2 / PCM_RATE
    for fmt, media, rate in [
        ("wav", "audio/wav", SAMPLE_RATE),
        ("flac", "audio/flac", SAMPLE_RATE),
        ("mp3", "audio/mpeg", SAMPLE_RATE),
        ("aac", "audio/aac", SAMPLE_RATE),
        ("opus", "audio/ogg", 48_000),
    ]:
        r = client.audio.speech.with_raw_response.create(
            model="voice", voice="am_tiny", input="Hello.", response_format=fmt
        )
        assert r.headers["content-type"] == media
        got_rate, channels, samples = decoded(r.content)
        assert (got_rate, channels) == (rate, 1), fmt
        # Codecs add priming and padding frames: within 60 ms of the pcm's length.
        assert samples / got_rate == pytest.approx(seconds, abs=0.06), fmt


def test_default_format_is_mp3_and_speed_changes_length(daemon) -> None:
    r = speak(daemon, input="Hello.")
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert decoded(r.content)[2] > 0
    fast = len(speak(daemon, input="Hi.", response_format="pcm", speed=2.0).content)
    slow = len(speak(daemon, input="Hi.", response_format="pcm", speed=0.5).content)
    normal = PCM_LINE
    # ffmpeg's atempo keeps the pitch and trims a few of its window's milliseconds.
    assert 0.4 * normal < fast < 0.6 * normal
    assert 1.6 * normal < slow < 2.2 * normal


def test_streams_in_pieces_and_sse(daemon) -> None:
    client = daemon.openai(api_key=MAIN)
    with client.audio.speech.with_streaming_response.create(
        model="voice", voice="af_tiny", input=TWO_LINES, response_format="wav"
    ) as r:
        pieces = [chunk for chunk in r.iter_bytes(64) if chunk]
        assert r.headers["content-type"] == "audio/wav"
    data = b"".join(pieces)
    assert data[:4] == b"RIFF" and decoded(data)[2] == 2 * SAMPLES_PER_LINE
    with daemon.client(headers={"Authorization": f"Bearer {MAIN}"}) as http:
        body = {"model": "voice", "input": TWO_LINES, "response_format": "pcm"}
        with http.stream("POST", "/v1/audio/speech", json=body) as r:
            raw = [chunk for chunk in r.iter_raw() if chunk]
    assert len(raw) >= 2  # a piece per generated line, not one body at the end
    sse = speak(daemon, input=TWO_LINES, response_format="pcm", stream_format="sse")
    assert sse.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(x[6:]) for x in sse.text.splitlines() if x.startswith("data: ")]
    kinds = [e["type"] for e in events]
    # A delta per line (and one for what the resampler held back), then done.
    assert len(kinds) >= 3 and kinds == ["speech.audio.delta"] * (len(kinds) - 1) + [
        "speech.audio.done"
    ]
    assert events[-1]["usage"]["output_tokens"] == 8  # 1 + 3 a line (Soprano counts its prefill)
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == 2 * PCM_LINE


def test_models_stats_metrics(daemon, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="mlxd.requests"):
        assert speak(daemon, input="Hi.", response_format="pcm").status_code == 200
        deadline = time.monotonic() + 10  # written once the last byte is sent
        while "POST /v1/audio/speech 200" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    # The request log line: the key, the model, one input, the audio tokens.
    assert "POST /v1/audio/speech 200 key=main model=voice inputs=1 generated=4" in caplog.text
    with daemon.client(headers={"Authorization": f"Bearer {MAIN}"}) as http:
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        stats = {m["id"]: m for m in http.get("/stats").json()["fleet"]["models"]}
        metrics = http.get("/metrics").text
        panel = http.get("/dashboard/models").text  # the dashboard's models panel
    assert models["voice"]["kind"] == "speech"
    assert models["voice"]["sample_rate"] == SAMPLE_RATE
    assert models["voice"]["voices"] == list(VOICES)
    assert stats["voice"]["engine"]["requests_served"] >= 1
    assert stats["voice"]["engine"]["audio_seconds"] > 0
    assert 'mlxd_embedding_requests_total{model="voice",outcome="served"}' in metrics
    assert 'mlxd_speech_audio_seconds_total{model="voice"}' in metrics
    assert '<code>voice</code> <span class="badge kind-speech">speech</span>' in panel


def test_usage_counts_the_text_read_in_stats_and_the_key_quota(daemon, tiny_tts_model) -> None:
    from transformers import AutoTokenizer

    text = "Hello there."
    read = len(AutoTokenizer.from_pretrained(str(tiny_tts_model)).encode(text))

    def input_tokens() -> int:
        with daemon.client(headers={"Authorization": f"Bearer {MAIN}"}) as http:
            stats = {m["id"]: m for m in http.get("/stats").json()["fleet"]["models"]}
        return stats["voice"]["engine"]["input_tokens"]

    before = input_tokens()
    sse = speak(daemon, "sk-tokens", input=text, response_format="pcm", stream_format="sse")
    assert sse.status_code == 200, sse.text
    done = json.loads([x for x in sse.text.splitlines() if x.startswith("data: ")][-1][6:])
    usage = done["usage"]
    assert usage["input_tokens"] == read > 0 and usage["output_tokens"] == 4
    assert usage["total_tokens"] == read + 4
    assert input_tokens() == before + read
    # 16 tokens spent of the key's 5 a minute: its next request is refused.
    refused = speak(daemon, "sk-tokens", input="Hi.", response_format="pcm")
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"input": ""}, 400, "input", "empty"),
        ({"input": "x" * 201}, 400, "input", "limits.speech_chars"),
        ({"input": "Hi.", "response_format": "ogg"}, 400, "response_format", "mp3"),
        ({"input": "Hi.", "speed": 4.5}, 400, "speed", "0.25"),
        ({"input": "Hi.", "speed": 0.1}, 400, "speed", "4.0"),
        ({"input": "Hi.", "speed": "fast"}, 400, None, "speed"),
        ({"input": "Hi.", "stream_format": "ndjson"}, 400, "stream_format", "sse"),
        ({"input": "Hi.", "colour": "red"}, 400, "colour", "colour"),
        ({"input": "Hi.", "model": "nope"}, 404, "model", "nope"),
        ({"input": "Hi.", "model": "chat"}, 400, "model", "/v1/chat/completions"),
        ({}, 400, None, "input"),
    ],
)
def test_bad_requests(daemon, body, status, param, words) -> None:
    r = speak(daemon, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_voices_and_instructions(daemon) -> None:
    r = speak(daemon, input="Hi.", voice="alloy")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "voice" and "af_tiny, am_tiny" in error["message"]
    r = speak(daemon, input="Hi.", voice="af_tiny", instructions="Calm.", response_format="pcm")
    assert r.status_code == 200
    assert r.headers["x-mlxd-ignored-parameters"] == "instructions"  # Soprano takes none


def test_keys_models_and_quotas(daemon) -> None:
    refused = speak(daemon, key="sk-chat-only", input="Hi.")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    assert speak(daemon, key="sk-one", input="Hi.", response_format="pcm").status_code == 200
    assert speak(daemon, key="sk-one", input="Hi.", response_format="pcm").status_code == 429


def test_no_pyav_is_501_for_its_formats(daemon, monkeypatch) -> None:
    from mlxd.engine.audio import encode

    monkeypatch.setattr(encode, "has_pyav", lambda: False)
    r = speak(daemon, input="Hi.", response_format="mp3")
    assert r.status_code == 501 and "pip install" in r.json()["error"]["message"]
    assert speak(daemon, input="Hi.", speed=2.0).status_code == 501
    assert speak(daemon, input="Hi.", response_format="wav").status_code == 200


def test_a_daemon_process_speaks_through_the_sdk(daemons, tiny_models, tiny_tts_model) -> None:
    """The one process-level check: ``mlxd serve`` in its own process, the openai SDK."""
    models = {
        "chat": {"path": str(tiny_models("llama"))},
        "tts": {"kind": "speech", "path": str(tiny_tts_model)},
    }
    client = daemons.get(toml_config(models=models)).openai()
    wav = client.audio.speech.create(
        model="tts", voice="af_tiny", input="Hi.", response_format="wav"
    )
    assert decoded(wav.content) == (SAMPLE_RATE, 1, SAMPLES_PER_LINE)
    with client.audio.speech.with_streaming_response.create(
        model="tts", voice="am_tiny", input="Hi.", response_format="pcm"
    ) as r:
        pcm = b"".join(r.iter_bytes())
    assert len(pcm) == PCM_LINE


def test_failures_before_and_after_the_first_byte(daemon, monkeypatch) -> None:
    import numpy as np

    from mlxd.engine.speech import loading

    def no_phonemizer(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'misaki'", name="misaki")
        yield  # a generator, as mlx-audio's generate() is

    def breaks_mid_way(*args, **kwargs):
        yield np.zeros(SAMPLES_PER_LINE, np.float32), 4
        raise RuntimeError("the model broke")

    monkeypatch.setattr(loading, "segments", no_phonemizer)
    r = speak(daemon, input="Hi.")
    assert r.status_code == 503, r.text
    assert "misaki" in r.json()["error"]["message"]
    monkeypatch.setattr(loading, "segments", breaks_mid_way)
    sse = speak(daemon, input="Hi.", response_format="pcm", stream_format="sse")
    events = [json.loads(x[6:]) for x in sse.text.splitlines() if x.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and "broke" in events[-1]["error"]["message"]
