"""Uploads for the audio tests: 16-bit mono WAV bytes from samples."""

from __future__ import annotations

import io
import wave

import numpy as np


def wav16(samples: np.ndarray, rate: int = 16_000) -> bytes:
    """``samples`` (int16, mono) as a WAV file's bytes."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype(np.int16).tobytes())
    return out.getvalue()
