"""Long thin images cost what the processor makes of them, refused from the header (N9).

A CLIP-style processor resizes an image by its shortest edge: a 200000x1 PNG of a
few hundred bytes became a 5,600,000x28 array and millions of image tokens. mlxd
now refuses such an image from its header, before decoding it: by
``[limits] image_aspect_ratio``, and (with that limit lifted) by ``image_pixels``
applied to the size after the processor's resize. Each refusal is a 400 in well
under 3 s, with the app's memory barely moving; an image just inside the limits
gets its answer.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zlib

import pytest

from tests.http.test_vision import b64, chat_body, openai_error
from tests.support.daemon import toml_config
from tests.support.tinyvlms import tiny_vlm_dir

PARAM = "messages[0].content[1].image_url"
PAGE = os.sysconf("SC_PAGE_SIZE")


def config(aspect: float = 200.0) -> str:
    return toml_config(
        batch={"size": 2},
        sampling={"max_tokens": 2},
        prompt_cache={"disk": False},
        limits={"image_pixels": 1 << 20, "image_aspect_ratio": aspect},
        models={"vlm": {"path": str(tiny_vlm_dir("llava")), "default": True, "pin": True}},
    )


@pytest.fixture(scope="module")
def daemon(apps):
    return apps.get(config())


def thin_png(width: int, height: int) -> bytes:
    """A real grey PNG of ``width`` x ``height`` (compresses to a few hundred bytes)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = (b"\0" + b"\x80" * width) * height
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 9))
        + chunk(b"IEND", b"")
    )


class PeakRss:
    """The process's resident memory sampled every 5 ms: the peak above the start."""

    def __init__(self) -> None:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / (1 << 20)


@pytest.mark.parametrize("size", [(200_000, 1), (1, 200_000), (600_000, 1)])
def test_a_long_thin_image_is_a_fast_cheap_400(daemon, size):
    png = thin_png(*size)
    with daemon.client() as http:
        with PeakRss() as rss:
            t0 = time.monotonic()
            r = http.post(
                "/v1/chat/completions", json=chat_body(f"data:image/png;base64,{b64(png)}")
            )
            elapsed = time.monotonic() - t0
        message = openai_error(r, "invalid_image", PARAM)
    assert "[limits] image_aspect_ratio" in message and f"{size[0]}x{size[1]}" in message
    assert elapsed < 3.0, elapsed
    assert rss.growth_mib < 200, rss.growth_mib


def test_with_the_ratio_lifted_the_resized_size_is_what_counts(daemon):
    daemon.write_config(config(aspect=1e7))
    assert daemon.reload().status_code == 200
    try:
        png = thin_png(200_000, 1)
        with daemon.client() as http, PeakRss() as rss:
            t0 = time.monotonic()
            r = http.post(
                "/v1/chat/completions", json=chat_body(f"data:image/png;base64,{b64(png)}")
            )
            elapsed = time.monotonic() - t0
        message = openai_error(r, "invalid_image", PARAM)
        # The tiny llava scales the shortest edge to 28: 200000x1 becomes 5,600,000x28.
        assert "5600000x28" in message and "[limits] image_pixels" in message
        assert elapsed < 3.0 and rss.growth_mib < 200, (elapsed, rss.growth_mib)
    finally:
        daemon.write_config(config())
        assert daemon.reload().status_code == 200


def test_an_image_inside_the_limits_is_answered(daemon):
    # 200:1, the default limit: resized to 5600x28 (156,800 pixels), then cropped.
    png = thin_png(200, 1)
    with daemon.client() as http:
        r = http.post("/v1/chat/completions", json=chat_body(f"data:image/png;base64,{b64(png)}"))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 4
