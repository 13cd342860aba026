"""Ogg Opus, M4A/AAC and WebM uploads through PyAV (FFmpeg), when it is installed (no MLX).

miniaudio (:mod:`.decode`) reads WAV, FLAC, MP3 and Ogg Vorbis. The other
containers browsers and phones record (Opus in Ogg or WebM, AAC in MP4) need
FFmpeg's decoders, which PyAV bundles; it comes with the ``audio`` extra for
text-to-speech's encoders. Without it those uploads stay a 400 saying what to
install or how to convert.

Only the demuxer the first bytes named is opened (no format probing), the
duration is checked from the header before decoding and again while
decoding (a header can lie), and everything FFmpeg raises becomes a 400.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

# The container sniff() names -> FFmpeg's demuxer for it.
DEMUXERS = {"opus": "ogg", "m4a": "mp4", "webm": "matroska"}
NAMES = {"opus": "Ogg Opus", "m4a": "M4A/AAC (MP4)", "webm": "WebM/Matroska"}


class Undecodable(Exception):
    """Not decodable: corrupt, truncated, no audio stream (the message is for the client)."""


class TooLong(Exception):
    """Longer than allowed; ``args[0]``: the seconds known so far."""


def available() -> bool:
    """Whether PyAV is installed (``pip install 'mlxd[audio]'``)."""
    return importlib.util.find_spec("av") is not None


def decode_av(
    data: bytes, container: str, *, sample_rate: int, max_seconds: float
) -> tuple[np.ndarray, float]:
    """``data``'s first audio stream as mono float32 at ``sample_rate``, and its header's
    duration in seconds (0 when the header has none).

    Raises:
        Undecodable: corrupt, truncated, no audio stream.
        TooLong: longer than ``max_seconds`` (by its header or as decoded).
    """
    import io

    import av

    name = NAMES[container]
    try:
        with av.open(io.BytesIO(data), mode="r", format=DEMUXERS[container]) as box:
            streams = box.streams.audio
            if not streams:
                raise Undecodable(f"The {name} file holds no audio stream.")
            stream = streams[0]
            seconds = _header_seconds(box, stream)
            if seconds > max_seconds:
                raise TooLong(seconds)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            pieces: list[np.ndarray] = []
            total = 0
            limit = int(max_seconds * sample_rate)
            for frame in box.decode(stream):
                for out in resampler.resample(frame):
                    piece = out.to_ndarray().reshape(-1)
                    total += piece.size
                    if total > limit:
                        raise TooLong(total / sample_rate)
                    pieces.append(piece)
            for out in resampler.resample(None):
                pieces.append(out.to_ndarray().reshape(-1))
    except (Undecodable, TooLong):
        raise
    except Exception as exc:  # FFmpeg's errors (av.error.*), and anything else it raises
        message = f"The {name} file could not be decoded (corrupt or truncated): {exc}."
        raise Undecodable(message) from None
    samples = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    return samples, seconds


def _header_seconds(box: Any, stream: Any) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if box.duration is not None:
        return box.duration / 1_000_000  # av.time_base
    return 0.0
