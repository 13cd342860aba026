"""Small points of issue 34: MIME-wrapped base64 images, an SVG's error, the disk-full message."""

from __future__ import annotations

import base64
import errno
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from mlxd.engine.chat import disk_writer
from mlxd.engine.images import ImageError, ImageLimits, from_base64

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20, max_images=4)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buf, "PNG", compress_level=0)
    return buf.getvalue()


def test_mime_wrapped_base64_is_taken():
    data = png()
    flat = base64.b64encode(data).decode()
    wrapped = "\r\n".join(flat[i : i + 76] for i in range(0, len(flat), 76)) + "\r\n"
    assert len(wrapped.splitlines()) > 2
    part = from_base64(wrapped, "image/png", "x", LIMITS)
    assert part.data == data and (part.width, part.height) == (64, 64)
    with pytest.raises(ImageError, match="not valid base64"):
        from_base64(flat[:-3] + "*==", "image/png", "x", LIMITS)


def test_an_svg_labelled_png_gets_a_clear_error():
    svg = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="10"/>'
    with pytest.raises(ImageError) as refused:
        from_base64(base64.b64encode(svg).decode(), "image/png", "x", LIMITS)
    message = str(refused.value)
    assert "SVG" in message and "PNG, JPEG, WebP or GIF" in message
    assert "BytesIO" not in message and "0x" not in message
    with pytest.raises(ImageError) as refused:
        from_base64(base64.b64encode(b"hello world").decode(), None, "x", LIMITS)
    assert "BytesIO" not in str(refused.value)


def test_the_disk_full_message_does_not_round_to_zero(monkeypatch, tmp_path: Path):
    usage = SimpleNamespace(total=10 * 2**30, used=0, free=300 * 1024)
    monkeypatch.setattr(disk_writer.shutil, "disk_usage", lambda _: (usage.total, 0, usage.free))
    with pytest.raises(OSError) as full:
        disk_writer._check_room(tmp_path, 4096)
    assert full.value.errno == errno.ENOSPC
    message = str(full.value)
    assert "leave 296 KiB free of 300 KiB" in message and "least 512 MiB" in message, message
    assert " 0 MiB" not in message
