"""Transcription ``stream=true`` (issue 37) through the openai SDK: the tiny Whisper's
text comes as one ``transcript.text.delta`` per decoded 30 s window, the first
before the last window is decoded, then one ``transcript.text.done`` whose text is
the deltas joined and the unstreamed answer's; srt with stream is a clear 400."""

from __future__ import annotations

import threading

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
        toml_config(models=models, limits={"audio_seconds": 60.0, "audio_bytes": "2MiB"})
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
