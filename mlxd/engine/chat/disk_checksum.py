"""A checksum of a disk entry's tensor bytes: flipped bytes are a corrupt file, no wrong answer.

A prompt-cache entry on disk (:mod:`.disk_writer`) is a safetensors file: an
8-byte header length, a JSON header (with mlxd's metadata), then the tensor
bytes. Its metadata carries a BLAKE2b digest of those bytes,
``payload_blake2b``: the writer saves the file with a placeholder of the
digest's length, hashes the payload it wrote and writes the digest over the
placeholder (:func:`seal`, the header keeps its length); a read checks it
(:func:`verify_payload`) before ``load_prompt_cache`` trusts the arrays.
The header itself is checked by its parser and by the file's size.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
from pathlib import Path
from typing import Any


class CorruptEntry(Exception):
    """A file that is not a whole, readable prompt-cache entry."""


def open_regular(path: Path) -> Any:
    """``path`` opened for reading if it is a regular file (never blocks, never follows a link).

    A FIFO, a device or a symlink named like an entry would hang a plain
    ``open`` (a FIFO without a writer) or lead out of the folder: opened
    with ``O_NONBLOCK | O_NOFOLLOW`` and checked with ``fstat``, it is a
    :class:`CorruptEntry` instead.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise CorruptEntry("a symbolic link, not a file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptEntry("not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


# The payload checksum's metadata key (under save_prompt_cache's "0." prefix), its size.
CHECKSUM = "payload_blake2b"
_DIGEST_BYTES = 16
# What the writer saves first, replaced in place by the digest (same length).
PLACEHOLDER = "-" * (2 * _DIGEST_BYTES)
_READ_CHUNK = 8 * 2**20


def _header_length(f: Any) -> int:
    f.seek(0)
    head = f.read(8)
    if len(head) != 8:
        raise CorruptEntry("shorter than a safetensors header")
    return struct.unpack("<Q", head)[0]


def _payload_digest(f: Any, start: int) -> str:
    """BLAKE2b of the file's bytes from ``start`` (the tensors) to its end, hex."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    f.seek(start)
    while chunk := f.read(_READ_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def verify_payload(path: Path, expected: str | None) -> None:
    """Check the tensor bytes of ``path`` against its metadata's checksum.

    Raises:
        CorruptEntry: no checksum (a file of an older mlxd), or one that does not match.
        OSError: the file cannot be read.
    """
    if not expected or len(expected) != 2 * _DIGEST_BYTES or expected == PLACEHOLDER:
        raise CorruptEntry("no checksum of its tensor bytes")
    with open_regular(path) as f:
        found = _payload_digest(f, 8 + _header_length(f))
    if found != expected:
        raise CorruptEntry(f"its tensor bytes do not match their checksum ({found} != {expected})")


def seal(f: Any) -> None:
    """Put the payload's checksum in place of the placeholder in a file just written."""
    n = _header_length(f)
    header = f.read(n)
    key = header.find(CHECKSUM.encode())
    at = header.find(PLACEHOLDER.encode(), key)
    if key < 0 or at < 0:
        raise ValueError("the checksum placeholder is missing from the header")
    digest = _payload_digest(f, 8 + n)
    f.seek(8 + at)
    f.write(digest.encode())
