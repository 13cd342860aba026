"""Text-to-speech's pure parts (issue 37): the voice and speed checks, a model's voices,
and the encoder: each format streamed in pieces decodes back to the samples fed."""

from __future__ import annotations

import io
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mlxd.engine.audio.encode import FORMATS, Encoder, EncoderUnavailable, check_format
from mlxd.engine.speech.loading import voices_of
from mlxd.engine.speech.voices import speed_refusal, voice_refusal

RATE = 24_000


def tone(seconds: float) -> np.ndarray:
    return (np.sin(np.arange(int(seconds * RATE)) / 7) * 0.5).astype(np.float32)


def test_voice_refusal_names_the_models_voices() -> None:
    assert voice_refusal("af_bella", ("af_bella", "am_adam"), "kokoro") is None
    assert voice_refusal("alloy", (), "soprano") is None  # one voice: ignored
    assert voice_refusal(None, ("a",), "m") is None
    message = voice_refusal("alloy", ("af_bella", "am_adam"), "kokoro")
    assert message is not None and "af_bella, am_adam" in message and "'alloy'" in message


def test_speed_bounds() -> None:
    assert speed_refusal(0.25) is None and speed_refusal(4.0) is None
    assert speed_refusal(0.24) is not None and speed_refusal(4.01) is not None


def test_voices_of_each_source(tmp_path: Path) -> None:
    speakers = SimpleNamespace(get_supported_speakers=lambda: ["Ryan", "Vivian"])
    assert voices_of(speakers, tmp_path) == ("Ryan", "Vivian")
    table = SimpleNamespace(voices={"expr-voice-2-f": 0, "expr-voice-1-m": 0})
    assert voices_of(table, tmp_path) == ("expr-voice-1-m", "expr-voice-2-f")
    (tmp_path / "voices").mkdir()
    for name in ("af_heart.safetensors", "am_adam.pt", "README.md"):
        (tmp_path / "voices" / name).write_bytes(b"")
    assert voices_of(SimpleNamespace(), tmp_path) == ("af_heart", "am_adam")
    assert voices_of(SimpleNamespace(), tmp_path / "none") == ()


def test_pcm_and_wav_without_pyav() -> None:
    samples = tone(0.1)
    pcm = Encoder("pcm", RATE)
    raw = pcm.feed(samples[:1000]) + pcm.feed(samples[1000:]) + pcm.close()
    assert len(raw) == 2 * samples.size
    assert np.abs(np.frombuffer(raw, "<i2") / 32767 - samples).max() < 1e-4
    wav = Encoder("wav", RATE)
    first = wav.feed(samples[:1000])
    assert first[:4] == b"RIFF" and len(first) == 44 + 2000  # the header goes first
    data = first + wav.feed(samples[1000:]) + wav.close()
    assert data[44:] == raw
    with wave.open(io.BytesIO(data[:4] + (len(data) - 8).to_bytes(4, "little") + data[8:])) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)


def test_pcm_is_openais_24khz(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("av")
    samples = (np.sin(np.arange(32_000) / 7) * 0.5).astype(np.float32)  # 1 s at 32 kHz
    enc = Encoder("pcm", 32_000)
    raw = enc.feed(samples[:10_000]) + enc.feed(samples[10_000:]) + enc.close()
    assert enc.out_rate == 24_000 and len(raw) == 2 * 24_000
    from mlxd.engine.audio import encode

    monkeypatch.setattr(encode, "has_pyav", lambda: False)
    plain = Encoder("pcm", 32_000)  # without PyAV: the model's rate
    assert plain.out_rate == 32_000 and len(plain.feed(samples) + plain.close()) == 64_000


def test_out_of_range_samples_are_clipped() -> None:
    enc = Encoder("pcm", RATE)
    raw = enc.feed(np.array([2.0, -3.0, 0.0], np.float32)) + enc.close()
    assert np.frombuffer(raw, "<i2").tolist() == [32767, -32767, 0]


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pcm"])
def test_each_format_streams_and_decodes(fmt: str) -> None:
    av = pytest.importorskip("av")
    samples = tone(0.5)
    enc = Encoder(fmt, RATE)
    parts = [enc.feed(piece) for piece in np.array_split(samples, 5)] + [enc.close()]
    with av.open(io.BytesIO(b"".join(parts))) as container:
        stream = container.streams.audio[0]
        got = sum(frame.samples for frame in container.decode(stream))
        rate, channels = stream.rate, stream.channels
    assert channels == 1 and rate == (48_000 if fmt == "opus" else RATE)
    assert got / rate == pytest.approx(0.5, abs=0.06)


def test_tempo_changes_length() -> None:
    pytest.importorskip("av")
    samples = tone(1.0)
    for speed in (0.25, 0.5, 2.0, 4.0):
        enc = Encoder("pcm", RATE, speed)
        raw = enc.feed(samples[:9000]) + enc.feed(samples[9000:]) + enc.close()
        assert len(raw) / 2 / RATE == pytest.approx(1.0 / speed, rel=0.05), speed


def test_missing_pyav_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxd.engine.audio import encode

    monkeypatch.setattr(encode, "has_pyav", lambda: False)
    check_format("wav")
    check_format("pcm")
    with pytest.raises(EncoderUnavailable, match=r"mlxd\[audio\]"):
        check_format("mp3")
    with pytest.raises(EncoderUnavailable, match="speed"):
        check_format("wav", 1.5)
