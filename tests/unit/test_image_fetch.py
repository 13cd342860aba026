"""``[server] fetch_images``: which addresses a remote image may come from, and the refusals.

The fetch itself runs against a real local HTTP server: a loopback address is refused
before any connection is made (the server sees no request).
"""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

from mlxd.api.image_fetch import fetch_one, refused_address
from mlxd.engine import ImageError, ImageLimits, ImagePart

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20, max_images=4)


@pytest.mark.parametrize(
    "address, why",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.1.10", "private"),
        ("172.16.0.1", "private"),
        ("100.64.0.1", "private"),  # CGNAT
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("fd00::1", "private"),
        ("224.0.0.1", "reserved"),
        ("0.0.0.0", "reserved"),
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
    ],
)
def test_only_public_addresses_may_be_fetched_from(address, why):
    got = refused_address(address)
    assert (got is None) if why is None else (got is not None and why in got)


def test_a_loopback_url_is_refused_before_connecting():
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for host in ("127.0.0.1", "localhost"):
            url = f"http://{host}:{server.server_address[1]}/cat.png"
            part = ImagePart(b"", "", 0, 0, "messages[0].content[0].image_url", url=url)
            with pytest.raises(ImageError, match="loopback") as caught:
                asyncio.run(fetch_one(part, LIMITS, 5.0))
            assert caught.value.param == "messages[0].content[0].image_url"
    finally:
        server.shutdown()
    assert hits == []


@pytest.mark.parametrize(
    "url, what",
    [("ftp://example.com/x.png", "http"), ("http://no-such-host.invalid/x.png", "resolved")],
)
def test_other_urls_are_refused(url, what):
    part = ImagePart(b"", "", 0, 0, "p", url=url)
    with pytest.raises(ImageError, match=what):
        asyncio.run(fetch_one(part, LIMITS, 5.0))
