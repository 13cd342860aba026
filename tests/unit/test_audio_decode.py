"""Uploaded audio decoded to 16 kHz mono (mlxd/engine/audio/decode.py, issue 37): WAV read
and resampled; not audio, truncated, too long, too big and undecodable containers each a
clear 4xx naming the problem."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from mlxd.engine.audio.decode import SAMPLE_RATE, AudioError, decode_audio, sniff

pytest.importorskip("miniaudio")

LIMITS = {"max_bytes": 10 * 1024 * 1024, "max_seconds": 30.0}


def wav(seconds: float = 1.0, rate: int = 44_100, channels: int = 2) -> bytes:
    frames = int(seconds * rate)
    tone = (np.sin(2 * np.pi * 440 * np.arange(frames) / rate) * 12_000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(tone, channels).tobytes())
    return buf.getvalue()


def refused(data: bytes, **limits) -> AudioError:
    with pytest.raises(AudioError) as caught:
        decode_audio(data, **{**LIMITS, **limits})
    return caught.value


def test_a_stereo_44k_wav_becomes_16k_mono_float_samples() -> None:
    decoded = decode_audio(wav(1.0), **LIMITS)
    assert decoded.container == "wav" and decoded.samples.dtype == np.float32
    assert abs(decoded.samples.size - SAMPLE_RATE) <= 2 and abs(decoded.seconds - 1.0) < 0.01
    assert 0.3 < float(np.abs(decoded.samples).max()) < 0.4  # 12000 / 32768, not noise


def test_containers_are_told_by_their_first_bytes() -> None:
    assert sniff(wav(0.1)) == "wav"
    assert sniff(b"fLaC\x00\x00\x00\x22") == "flac"
    assert sniff(b"OggS\x00\x02" + b"\x00" * 22 + b"\x01vorbis") == "ogg"
    assert sniff(b"OggS\x00\x02" + b"\x00" * 22 + b"OpusHead") == "opus"
    assert sniff(b"ID3\x04\x00") == "mp3" and sniff(b"\xff\xfb\x90\x00") == "mp3"
    assert sniff(b"\x00\x00\x00\x20ftypM4A ") == "m4a"
    assert sniff(b"\x1a\x45\xdf\xa3\x9f") == "webm"
    assert sniff(b"hello") == "unknown"


@pytest.mark.parametrize(
    ("data", "status", "needle"),
    [
        (b"", 400, "empty"),
        (b"just some text, not audio" * 20, 400, "not audio"),
        (b"%PDF-1.7\n" + b"x" * 200, 400, "ffmpeg"),
        (b"\x00\x00\x00\x20ftypM4A " + b"\x00" * 100, 400, "M4A/AAC"),
        (b"\x1a\x45\xdf\xa3" + b"\x00" * 100, 400, "WebM"),
        (wav(1.0)[:20_000], 400, "truncated"),
        (b"fLaC" + b"\x00" * 100, 400, "could not be"),
    ],
)
def test_bad_uploads_are_clear_refusals(data: bytes, status: int, needle: str) -> None:
    error = refused(data)
    assert error.status == status and needle in error.message and error.param == "file"


def test_limits_refuse_before_decoding() -> None:
    long = wav(3.0, rate=8_000, channels=1)
    assert "at most 2 s" in refused(long, max_seconds=2.0).message
    big = refused(long, max_bytes=1_000)
    assert big.status == 413 and "at most 1000 bytes" in big.message


def encoded(container: str, seconds: float = 1.5) -> bytes:
    """A 440 Hz tone as a browser or phone records it, written by PyAV (FFmpeg)."""
    av = pytest.importorskip("av")
    fmt, codec, rate = {
        "m4a": ("mp4", "aac", 44_100),
        "webm": ("webm", "libopus", 48_000),
        "opus": ("ogg", "libopus", 48_000),
    }[container]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as box:
        stream = box.add_stream(codec, rate=rate, layout="mono")
        tone = np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(tone.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            box.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("container", ["m4a", "webm", "opus"])
def test_m4a_webm_and_opus_decode_through_pyav(container: str) -> None:
    data = encoded(container)
    assert sniff(data) == container
    out = decode_audio(data, **LIMITS)
    assert out.container == container and abs(out.seconds - 1.5) < 0.1
    # The tone survives: its spectrum peaks at 440 Hz.
    spectrum = np.abs(np.fft.rfft(out.samples))
    peak = np.argmax(spectrum) * SAMPLE_RATE / out.samples.size
    assert abs(peak - 440) < 5
    assert "at most 1 s" in refused(data, max_seconds=1.0).message
    # Truncated: a clear 400, or (a streamable container) what is there.
    try:
        partial = decode_audio(data[: len(data) // 3] + b"\x00" * 64, **LIMITS)
    except AudioError as error:
        assert error.status == 400 and "could not be decoded" in error.message
    else:
        assert 0 < partial.seconds < out.seconds


def test_without_pyav_those_containers_name_what_to_install(monkeypatch) -> None:
    from mlxd.engine.audio import decode_av

    monkeypatch.setattr(decode_av, "available", lambda: False)
    error = refused(b"\x00\x00\x00\x20ftypM4A " + b"\x00" * 100)
    assert error.status == 400 and "mlxd[audio]" in error.message and "ffmpeg" in error.message
