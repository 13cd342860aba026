"""Speech as OpenAI's ``response_format``s, encoded as it is generated (PyAV; no MLX).

Text-to-speech's encoding half (issue 37, ``kind = "speech"``). An
:class:`Encoder` takes float samples in [-1, 1] as the model makes them and
gives back the bytes of the answer so far, so every format streams:

- ``pcm``: raw 16-bit little-endian mono at 24 kHz as OpenAI's (resampled by
  PyAV from the model's rate; without PyAV, the model's rate), the rate also
  said in a response header;
- ``wav``: PCM in a RIFF header written for a stream (the sizes unknown:
  ``0xFFFFFFFF``, as OpenAI's streamed wav has them);
- ``mp3`` (LAME), ``opus`` (libopus in Ogg, resampled to 48 kHz), ``aac``
  (ADTS), ``flac``: ffmpeg's encoders and muxers through PyAV (its wheels
  bundle them), written to a sink that cannot seek.

``speed`` other than 1 runs the samples through ffmpeg's ``atempo`` filter
(tempo changed, pitch kept) for models that cannot speak faster themselves.
Nothing here is a hand-written encoder (mlx-audio's own server writes wav with
miniaudio and runs an ``ffmpeg`` binary for the rest, which a machine may lack;
PyAV's wheels carry the libraries). Without PyAV only ``pcm`` and ``wav`` are
available, and :func:`check_format` says what to install.
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
# libopus's rate (of those it takes, the one every model's rate resamples to cleanly).
OPUS_RATE = 48_000
# OpenAI's pcm: 24 kHz, 16-bit little-endian mono.
PCM_RATE = 24_000


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
    """One answer's encoder: :meth:`feed` samples as they come, :meth:`close` at the end.

    :attr:`out_rate` is the answer's sample rate: the model's, but 48 kHz for
    ``opus`` (libopus's rate) and OpenAI's 24 kHz for ``pcm`` when PyAV is
    there to resample (a ``pcm`` reader cannot be told the rate in the data).
    """

    def __init__(self, fmt: str, rate: int, speed: float = 1.0):
        if fmt not in MEDIA_TYPES:
            raise ValueError(f"unknown format {fmt!r}")
        check_format(fmt, speed)
        self.format, self.rate = fmt, rate
        self._tempo = _Tempo(rate, speed) if speed != 1.0 else None
        self._started = False
        self._container: Any = None
        self._stream: Any = None
        self._resampler: Any = None
        self._sink = _Sink()
        self._pts = 0
        self.out_rate = rate
        if fmt == "opus":
            self.out_rate = OPUS_RATE
        elif fmt == "pcm" and rate != PCM_RATE and has_pyav():
            self.out_rate = PCM_RATE
        if self.out_rate != rate:
            import av

            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=self.out_rate)
        if fmt in _PYAV:
            import av

            muxer, codec = _PYAV[fmt]
            # Ogg pages of 20 ms: the default second-long page would hold the stream back.
            options = {"page_duration": "20000"} if muxer == "ogg" else {}
            self._container = av.open(self._sink, mode="w", format=muxer, options=options)
            stream: Any = self._container.add_stream(codec, rate=self.out_rate, layout="mono")
            self._stream = stream

    def feed(self, samples: np.ndarray) -> bytes:
        """The encoded bytes for ``samples`` (float mono), as far as the encoder has gone."""
        data = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._tempo is not None:
            data = self._tempo.push(data)
        return self._encode(self._frames(data))

    def close(self) -> bytes:
        """The answer's last bytes (what the encoder held back, the container's trailer)."""
        tail = self._tempo.push(None) if self._tempo is not None else np.zeros(0, np.float32)
        frames = self._frames(tail)
        if self._resampler is not None:
            frames += list(self._resampler.resample(None))
        out = self._encode(frames)
        if self._container is None:
            return out
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return out + self._sink.take()

    def _frames(self, data: np.ndarray) -> list[Any]:
        """``data`` as PyAV frames at :attr:`out_rate` (plain arrays without PyAV)."""
        if self._container is None and self._resampler is None:
            return [data] if data.size else []
        if not data.size:
            return []
        import av

        frame = av.AudioFrame.from_ndarray(
            np.clip(data, -1.0, 1.0)[None, :], format="flt", layout="mono"
        )
        frame.sample_rate = self.rate
        frame.pts = self._pts
        frame.time_base = Fraction(1, self.rate)
        self._pts += data.size
        return list(self._resampler.resample(frame)) if self._resampler is not None else [frame]

    def _encode(self, frames: list[Any]) -> bytes:
        head = b""
        if not self._started:
            self._started = True
            head = wav_stream_header(self.out_rate) if self.format == "wav" else b""
        if self._container is None:  # pcm, wav: the samples themselves
            arrays = [
                f if isinstance(f, np.ndarray) else f.to_ndarray().reshape(-1) for f in frames
            ]
            return head + b"".join(to_int16(a).tobytes() for a in arrays)
        for frame in frames:
            self._container.mux(self._stream.encode(frame))
        return self._sink.take()
