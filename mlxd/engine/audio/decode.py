"""An uploaded audio file as 16 kHz mono float32 samples, checked first (no MLX).

The decoding half of speech-to-text (``kind = "transcription"``). The container
is told by its first bytes, never by the file name or the client's content
type: WAV (``RIFF....WAVE``), FLAC (``fLaC``), Ogg Vorbis (``OggS`` with a
Vorbis header) and MP3 (an ID3 tag or an MPEG frame sync) are decoded and
resampled by miniaudio (a dependency of mlx-audio). Ogg Opus, M4A/AAC
(``ftyp``) and WebM/Matroska go through PyAV (:mod:`.decode_av`) when it is
installed, else a 400 says what to install or how to convert them (ffmpeg);
anything else is a 400.

Limits come before the decode: the upload's bytes (``max_bytes``), then its
duration read from the header (``max_seconds``), so a long file is refused
without being decoded. A WAV whose data chunk is shorter than its header says
is refused as truncated; other containers decode what is there, and a file
that yields no samples is refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxd.engine.audio import decode_av

SAMPLE_RATE = 16_000  # what Whisper and Parakeet read

CONVERT = "convert it to WAV, FLAC, MP3 or Ogg Vorbis first, e.g. `ffmpeg -i in.m4a out.wav`"


class AudioError(Exception):
    """An upload that cannot be transcribed: the status and message a client reads."""

    def __init__(self, status: int, message: str, code: str = "invalid_value", param: str = "file"):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass(frozen=True)
class Decoded:
    """Mono float32 samples at :data:`SAMPLE_RATE`, and what they came from."""

    samples: np.ndarray
    container: str
    seconds: float


def sniff(data: bytes) -> str:
    """The container of ``data`` by its first bytes: wav, flac, ogg, mp3, or what it is not.

    Returns one of ``wav``, ``flac``, ``ogg``, ``mp3`` (decodable), ``opus``,
    ``m4a``, ``webm`` (known, not decodable here) or ``unknown``.
    """
    head = data[:64]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "opus" if b"OpusHead" in head else "ogg"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    if head[4:8] == b"ftyp":
        return "m4a"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    return "unknown"


def wav_truncated(data: bytes) -> bool:
    """Whether a WAV's ``data`` chunk declares more bytes than the upload holds."""
    at = 12
    while at + 8 <= len(data):
        name, size = data[at : at + 4], struct.unpack("<I", data[at + 4 : at + 8])[0]
        if name == b"data":
            return size != 0xFFFFFFFF and at + 8 + size > len(data)  # streamed WAVs: no size
        at += 8 + size + (size & 1)
    return True  # no data chunk at all


def decode_audio(data: bytes, *, max_bytes: int, max_seconds: float) -> Decoded:
    """``data`` (an uploaded file) as 16 kHz mono samples; raises AudioError (400/413).

    Raises:
        AudioError: 413 over ``max_bytes``; 400 empty, not audio, a container
            that is not decodable here (the message says how to convert it),
            truncated, undecodable, longer than ``max_seconds``, or silent of
            samples.
    """
    if len(data) > max_bytes:
        raise AudioError(
            413, f"The audio file is {len(data)} bytes; at most {max_bytes} bytes are accepted."
        )
    if not data:
        raise AudioError(400, "The audio file is empty.")
    container = sniff(data)
    if container in decode_av.DEMUXERS:
        return _decode_av(data, container, max_seconds)
    if container == "unknown":
        raise AudioError(
            400,
            "The file is not audio this server can read (no WAV, FLAC, MP3 or Ogg Vorbis "
            f"header): {CONVERT}.",
            code="unsupported_audio_format",
        )
    if container == "wav" and wav_truncated(data):
        raise AudioError(
            400, "The WAV file is truncated: its data is shorter than its header says."
        )
    miniaudio = _miniaudio()
    seconds = _duration(miniaudio, container, data)
    if seconds > max_seconds:
        raise AudioError(
            400,
            f"The audio is {seconds:.1f} s long; at most {max_seconds:g} s are accepted. "
            "Split it into shorter files.",
        )
    try:
        sound = miniaudio.decode(
            data,
            output_format=miniaudio.SampleFormat.FLOAT32,
            nchannels=1,
            sample_rate=SAMPLE_RATE,
        )
    except miniaudio.DecodeError as exc:
        raise AudioError(
            400, f"The {container} file could not be decoded (corrupt or truncated): {exc}."
        ) from None
    samples = np.frombuffer(sound.samples, dtype=np.float32).copy()
    if samples.size == 0:
        raise AudioError(400, f"The {container} file holds no audio samples.")
    return Decoded(samples, container, samples.size / SAMPLE_RATE)


def _decode_av(data: bytes, container: str, max_seconds: float) -> Decoded:
    """Ogg Opus, M4A/AAC or WebM through PyAV, or a 400 saying what to install."""
    name = decode_av.NAMES[container]
    if not decode_av.available():
        raise AudioError(
            400,
            f"{name} audio needs PyAV on this server (`pip install 'mlxd[audio]'`; miniaudio "
            f"reads WAV, FLAC, MP3 and Ogg Vorbis): {CONVERT}.",
            code="unsupported_audio_format",
        )
    try:
        samples, _ = decode_av.decode_av(
            data, container, sample_rate=SAMPLE_RATE, max_seconds=max_seconds
        )
    except decode_av.TooLong as exc:
        raise AudioError(
            400,
            f"The audio is at least {float(exc.args[0]):.1f} s long; at most {max_seconds:g} s "
            "are accepted. Split it into shorter files.",
        ) from None
    except decode_av.Undecodable as exc:
        raise AudioError(400, f"{exc} Or {CONVERT}.") from None
    if samples.size == 0:
        raise AudioError(400, f"The {name} file holds no audio samples.")
    return Decoded(samples, container, samples.size / SAMPLE_RATE)


def _duration(miniaudio: Any, container: str, data: bytes) -> float:
    getters = {
        "wav": miniaudio.wav_get_info,
        "flac": miniaudio.flac_get_info,
        "ogg": miniaudio.vorbis_get_info,
        "mp3": miniaudio.mp3_get_info,
    }
    try:
        info = getters[container](data)
    except miniaudio.DecodeError as exc:
        raise AudioError(
            400, f"The {container} file's header could not be read (corrupt or truncated): {exc}."
        ) from None
    return float(info.num_frames) / max(int(info.sample_rate), 1)


def _miniaudio() -> Any:
    try:
        import miniaudio
    except ImportError as exc:
        raise AudioError(
            503,
            f"Audio decoding needs the miniaudio package ({exc}): `pip install miniaudio` "
            "(it comes with mlx-audio), then restart mlxd.",
            code="audio_decoder_missing",
        ) from None
    return miniaudio
