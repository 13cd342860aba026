"""Transcription ``stream=true`` (issue 37) through the openai SDK: the tiny Whisper's
text comes as one ``transcript.text.delta`` per decoded 30 s window, the first
before the last window is decoded, then one ``transcript.text.done`` whose text is
the deltas joined and the unstreamed answer's; srt with stream is a clear 400. A client
that leaves, streamed or not, stops its upload before the next window (windows counted
by a hook on the decoder, no timing)."""

from __future__ import annotations

import socket
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import pytest

from tests.support.audio import wav16
from tests.support.daemon import toml_config

pytest.importorskip("mlx_audio")

SECONDS = 40.0  # two windows: 0-30 s and 30-40 s


def noise_wav(seconds: float, rate: int = 16_000) -> bytes:
    rng = np.random.default_rng(0)
    return wav16(rng.standard_normal(int(seconds * rate)) * 3000, rate)


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    from tests.support.tinywhisper import tiny_whisper_dir

    models = {
        "chat": {"path": str(tiny_models("llama"))},  # the registry needs a chat model
        "whisper": {"kind": "transcription", "path": str(tiny_whisper_dir(talkative=True))},
    }
    return apps.get(
        toml_config(models=models, limits={"audio_seconds": 80.0, "audio_bytes": "3MiB"})
    )


def test_stream_sends_each_window_as_it_is_decoded(daemon, monkeypatch) -> None:
    from mlx_audio.stt.models.whisper.whisper import Model

    real = Model.decode
    seen_delta = threading.Event()
    calls: list[int] = []
    waited: list[bool] = []  # per window after the first: had the client a delta by then?

    def decode(self, segment, options):
        calls.append(1)
        if len(calls) > 1:
            waited.append(seen_delta.wait(timeout=20))
        return real(self, segment, options)

    monkeypatch.setattr(Model, "decode", decode)
    client = daemon.openai()
    audio = ("a.wav", noise_wav(SECONDS))
    events = []
    for event in client.audio.transcriptions.create(model="whisper", file=audio, stream=True):
        events.append(event)
        if event.type == "transcript.text.delta":
            seen_delta.set()
    types = [e.type for e in events]
    assert types[-1] == "transcript.text.done" and types.count("transcript.text.done") == 1
    deltas = [e.delta for e in events[:-1]]
    assert set(types[:-1]) == {"transcript.text.delta"} and len(deltas) >= 2, types
    assert waited and all(waited), waited  # the first delta came before the last window
    done = events[-1].text
    assert done and done == "".join(deltas)
    plain = client.audio.transcriptions.create(model="whisper", file=audio)
    assert plain.text == done
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(
            model="whisper", file=audio, stream=True, response_format="srt"
        )
    assert bad.value.status_code == 400
    assert "json or text" in bad.value.message and bad.value.param == "stream"


class Windows:
    """Which upload each decoded window belongs to; the ``hold_at``-th window waits (up to
    20 s) until its upload is cancelled, so the client can leave while it runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold_at: int):
        from mlx_audio.stt.models.whisper.whisper import Model

        from mlxd.engine.transcription import loading

        self.decoded: list[Any] = []  # the job of each window, in order
        self.held = threading.Event()
        self.cancelled: list[bool] = []  # the held window's job: cancelled in time?
        current: list[Any] = []
        real_transcribe, real_decode = loading.transcribe, Model.decode

        def transcribe(loaded: Any, job: Any) -> Any:
            current[:] = [job]
            return real_transcribe(loaded, job)

        def decode(model: Any, segment: Any, options: Any) -> Any:
            self.decoded.append(current[0])
            if len(self.decoded) == hold_at:
                self.held.set()
                self.cancelled.append(current[0].cancelled.wait(timeout=20))
            return real_decode(model, segment, options)

        monkeypatch.setattr(loading, "transcribe", transcribe)
        monkeypatch.setattr(Model, "decode", decode)

    def per_job(self) -> list[int]:
        """Windows decoded per upload, in the order the uploads ran."""
        ids = [id(job) for job in self.decoded]
        return [ids.count(i) for i in dict.fromkeys(ids)]


def test_a_stream_whose_client_leaves_stops_at_the_next_window(daemon, monkeypatch) -> None:
    windows = Windows(monkeypatch, hold_at=2)
    client = daemon.openai()
    stream = client.audio.transcriptions.create(
        model="whisper", file=("a.wav", noise_wav(70.0)), stream=True
    )
    first = next(iter(stream))  # window 1's text, sent as window 2 begins
    assert first.type == "transcript.text.delta" and first.delta
    stream.close()
    # The model is free for the next upload (FIFO: it ran after the cancelled one).
    after = client.audio.transcriptions.create(model="whisper", file=("b.wav", noise_wav(5.0)))
    assert isinstance(after.text, str)
    assert windows.cancelled == [True]
    counts = windows.per_job()
    assert counts[0] == 2 and len(counts) == 2, counts  # 70 s: window 3 never began


def test_an_unstreamed_upload_whose_client_leaves_stops_at_the_next_window(
    daemon, monkeypatch
) -> None:
    windows = Windows(monkeypatch, hold_at=1)
    request = httpx.Request(
        "POST",
        f"{daemon.url}/v1/audio/transcriptions",
        files={"file": ("a.wav", noise_wav(SECONDS))},
        data={"model": "whisper"},
    )
    body = request.read()
    url = urlsplit(daemon.url)
    head = (
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: {request.headers['content-type']}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head.encode() + body)
        assert windows.held.wait(timeout=20)  # its first window is being decoded
    client = daemon.openai()
    after = client.audio.transcriptions.create(model="whisper", file=("b.wav", noise_wav(5.0)))
    assert isinstance(after.text, str)
    assert windows.cancelled == [True]
    counts = windows.per_job()
    assert counts[0] == 1 and len(counts) == 2, counts  # window 2 never began
