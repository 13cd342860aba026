"""Speech as OpenAI's ``response_format``s, encoded as it is generated (PyAV; no MLX).

Text-to-speech's encoding half (issue 37, ``kind = "speech"``). An
:class:`Encoder` takes float samples in [-1, 1] as the model makes them and
gives back the bytes of the answer so far, so every format streams:

- ``pcm``: raw 16-bit little-endian mono at the model's rate (OpenAI's ``pcm``
  is 24 kHz; here the model's rate, which the route says in a header);
- ``wav``: PCM in a RIFF header written for a stream (the sizes unknown:
  ``0xFFFFFFFF``, as OpenAI's streamed wav has them);
- ``mp3`` (LAME), ``opus`` (libopus in Ogg, resampled to 48 kHz), ``aac``
  (ADTS), ``flac``: ffmpeg's encoders and muxers through PyAV (its wheels
  bundle them), written to a sink that cannot seek.

``speed`` other than 1 runs the samples through ffmpeg's ``atempo`` filter
(tempo changed, pitch kept) for models that cannot speak faster themselves.
Nothing here is a hand-written encoder. Without PyAV only ``pcm`` and ``wav``
are available, and :func:`check_format` says what to install.
"""

from __future__ import annotations

import importlib.util
from fractions import Fraction
from typing import Any

import numpy as np

# OpenAI's formats and each one's media type.
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
FORMATS = tuple(MEDIA_TYPES)

# format -> (muxer, encoder)
_PYAV = {
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "flac": ("flac", "flac"),
}
_PYAV_NEEDED = frozenset(_PYAV)


class EncoderUnavailable(Exception):
    """The format's encoder is not installed; the message says what to install."""


def check_format(fmt: str, speed: float = 1.0) -> None:
    """Raise :class:`EncoderUnavailable` when ``fmt`` (or ``speed``) needs what is missing."""
    needs = fmt in _PYAV_NEEDED or speed != 1.0
    if not needs or has_pyav():
        return
    what = f"response_format '{fmt}'" if fmt in _PYAV_NEEDED else "a speed other than 1.0"
    raise EncoderUnavailable(
        f"{what} needs PyAV, which this server lacks: pip install 'mlxd[audio]' (or "
        "pip install av). 'wav' and 'pcm' work without it."
    )


def has_pyav() -> bool:
    """Whether PyAV (``av``) is installed."""
    return importlib.util.find_spec("av") is not None


def wav_stream_header(rate: int) -> bytes:
    """A RIFF/WAVE header for 16-bit mono PCM of unknown length (a stream's)."""
    import struct

    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + (b"data" + struct.pack("<I", unknown))
    )


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples as 16-bit integers, clipped to [-1, 1] first."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).astype("<i2")


class _Sink:
    """Where a muxer writes: bytes taken out as they come, never seekable."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


class _Tempo:
    """ffmpeg's ``atempo`` over float mono samples (chained: each stage takes 0.5 to 2)."""

    def __init__(self, rate: int, speed: float):
        import av.filter

        graph = av.filter.Graph()
        src = graph.add_abuffer(format="flt", sample_rate=rate, layout="mono")
        last = src
        left = speed
        stages: list[float] = []
        while left > 2.0:
            stages.append(2.0)
            left /= 2.0
        while left < 0.5:
            stages.append(0.5)
            left /= 0.5
        stages.append(left)
        for stage in stages:
            node = graph.add("atempo", f"{stage:.6f}")
            last.link_to(node)
            last = node
        sink = graph.add("abuffersink")
        last.link_to(sink)
        graph.configure()
        self._graph, self._rate, self._pts = graph, rate, 0

    def push(self, samples: np.ndarray | None) -> np.ndarray:
        import av
        import av.error

        graph = self._graph
        if samples is None:
            graph.push(None)
        elif samples.size:
            frame = av.AudioFrame.from_ndarray(
                samples.astype(np.float32)[None, :], format="flt", layout="mono"
            )
            frame.sample_rate = self._rate
            frame.pts = self._pts
            frame.time_base = Fraction(1, self._rate)
            self._pts += samples.size
            graph.push(frame)
        out: list[np.ndarray] = []
        while True:
            try:
                frame = graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32))
        return np.concatenate(out) if out else np.zeros(0, np.float32)


class Encoder:
    """One answer's encoder: :meth:`feed` samples as they come, :meth:`close` at the end."""

    def __init__(self, fmt: str, rate: int, speed: float = 1.0):
        if fmt not in MEDIA_TYPES:
            raise ValueError(f"unknown format {fmt!r}")
        check_format(fmt, speed)
        self.format, self.rate = fmt, rate
        self._tempo = _Tempo(rate, speed) if speed != 1.0 else None
        self._started = False
        self._container: Any = None
        self._stream: Any = None
        self._sink = _Sink()
        self._pts = 0
        if fmt in _PYAV:
            import av

            muxer, codec = _PYAV[fmt]
            self._container = av.open(self._sink, mode="w", format=muxer)
            out_rate = 48_000 if fmt == "opus" else rate
            stream: Any = self._container.add_stream(codec, rate=out_rate, layout="mono")
            self._stream = stream
            if fmt == "opus" and out_rate != rate:
                self._resampler = av.AudioResampler(format="flt", layout="mono", rate=out_rate)
            else:
                self._resampler = None

    def feed(self, samples: np.ndarray) -> bytes:
        """The encoded bytes for ``samples`` (float mono), as far as the encoder has gone."""
        data = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._tempo is not None:
            data = self._tempo.push(data)
        return self._encode(data)

    def close(self) -> bytes:
        """The answer's last bytes (what the encoder held back, the container's trailer)."""
        tail = self._tempo.push(None) if self._tempo is not None else np.zeros(0, np.float32)
        out = self._encode(tail)
        if self._container is None:
            return out
        for frame in self._resample(None):
            self._container.mux(self._stream.encode(frame))
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return out + self._sink.take()

    def _encode(self, data: np.ndarray) -> bytes:
        head = b""
        if not self._started:
            self._started = True
            head = wav_stream_header(self.rate) if self.format == "wav" else b""
        if self._container is None:  # pcm, wav
            return head + (to_int16(data).tobytes() if data.size else b"")
        if not data.size:
            return self._sink.take()
        import av

        frame = av.AudioFrame.from_ndarray(
            np.clip(data, -1.0, 1.0)[None, :], format="flt", layout="mono"
        )
        frame.sample_rate = self.rate
        frame.pts = self._pts
        frame.time_base = Fraction(1, self.rate)
        self._pts += data.size
        for out in self._resample(frame):
            self._container.mux(self._stream.encode(out))
        return self._sink.take()

    def _resample(self, frame: Any) -> list[Any]:
        if self._resampler is None:
            return [frame] if frame is not None else []
        return list(self._resampler.resample(frame))
