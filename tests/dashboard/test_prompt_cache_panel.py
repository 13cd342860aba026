"""The prompt-cache panel in a real browser: hit ratio, tiers, and the last misses explained.

One daemon bound off loopback (``--host 0.0.0.0``, reached via 127.0.0.1)
with an admin token and anonymous reading. Two conversations share a long
system prompt and part at a user turn whose text is hostile markup: an
anonymous reader sees the counts and where each prompt diverged but no
prompt text; an admin also sees the text on both sides of the point, as
text. At 1280 px and at 390 px (a phone: cards, no sideways scrolling).
``MLXD_SCREENSHOT=1`` writes docs/img/dashboard-prompt-cache.png and
docs/img/dashboard-prompt-cache-phone.png.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT
from tests.support.browser import frozen, wait_for_swap
from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

ADMIN_TOKEN = "adm-test-" + uuid.uuid4().hex
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
HOSTILE = "<img src=x onerror=window.pwned=1>"
SYSTEM = "You are a careful coding agent working in a large repository. " * 10
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def daemon(daemons) -> Daemon:
    config = toml_config(
        server={"admin_token": ADMIN_TOKEN, "allow_anonymous_read": True},
        model={"path": str(tiny_model_dir("llama")), "name": "tiny"},
        batch={"size": 2},
        sampling={"max_tokens": 6},
    )
    return daemons.get(config, name="prompt-cache-panel", args=["--host", "0.0.0.0"])


def _chat(d: Daemon, user: str) -> str:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }
    r = httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    return r.headers["x-mlxd-prompt-cache"]


def _shot(page, name: str, tmp_path: Path, *, full_page: bool = False) -> None:
    keep = os.environ.get("MLXD_SCREENSHOT") == "1"
    path = (ROOT / "docs" / "img" if keep else tmp_path) / name
    page.screenshot(path=str(path), full_page=full_page)
    assert path.stat().st_size > 10_000


@pytest.mark.browser
def test_prompt_cache_panel_explains_misses(daemon: Daemon, pages, tmp_path: Path) -> None:
    marker = "q" + uuid.uuid4().hex[:12]
    _chat(daemon, "Which files define the HTTP routes?")  # a miss: the cache is empty
    _chat(daemon, "Which files define the HTTP routes?")  # the same prompt: a full hit
    partial = _chat(daemon, f"{HOSTILE} {marker} where is the config read?")  # parts here
    diverged = partial.rsplit("diverged_at=", 1)[1]

    problems: list[str] = []
    reader = pages(viewport={"width": 1280, "height": 900})
    reader.on("pageerror", lambda e: problems.append(str(e)))
    reader.goto(f"{daemon.url}/dashboard")
    reader.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")
    with frozen(reader):  # the panel polls: read one version of it
        panel = reader.locator("#prompt-cache")
        # The numbers: most prompt tokens came from the cache in memory, none from disk.
        ratio = float(panel.locator("[data-field=hit-ratio]").inner_text().rstrip("%"))
        assert 30 < ratio < 100, ratio
        assert panel.locator("[data-field=ram-tokens]").inner_text() != "0"
        assert panel.locator("[data-field=disk-tokens]").inner_text() == "0"
        assert panel.locator("[data-field=disk-state]").inner_text() in ("on", "off")
        # Two misses (the first lookup and the partial hit), newest first, with where they parted.
        rows = panel.locator("tbody tr")
        assert rows.count() == 2
        parted = rows.first.locator("[data-field=diverged-at]").inner_text()
        assert parted.startswith(f"{int(diverged):,}")
        # No prompt text for a reader without the token: a note and a login link instead.
        assert panel.locator("[data-field=snippet]").count() == 0
        assert "for admins" in panel.inner_text()
    assert marker not in reader.content()

    admin = pages(extra_http_headers=ADMIN, viewport={"width": 1280, "height": 900})
    admin.on("pageerror", lambda e: problems.append(str(e)))
    admin.goto(f"{daemon.url}/dashboard")
    admin.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")
    with frozen(admin):
        snippet = admin.locator("#prompt-cache tbody tr").first.locator("[data-field=snippet]")
        # The text after the divergence point starts with the user's new words, shown as text.
        after = snippet.locator(".after").inner_text()
        assert after.startswith(HOSTILE[:20]), after
        before = snippet.locator(".before").inner_text()
        assert before.endswith("user⏎"), "newlines are made visible"
        assert admin.locator("#prompt-cache img").count() == 0
    # A poll replaces the region with the same content (the partial route renders it alone).
    wait_for_swap(admin, "#prompt-cache", timeout=WAIT_MS)
    with frozen(admin):
        assert admin.locator("#prompt-cache [data-field=snippet]").count() == 2
    assert admin.evaluate("window.pwned") is None
    admin.evaluate("document.getElementById('prompt-cache').scrollIntoView()")
    _shot(admin, "dashboard-prompt-cache.png", tmp_path)

    phone = pages(
        extra_http_headers=ADMIN, viewport={"width": 390, "height": 844}, device_scale_factor=2
    )
    phone.on("pageerror", lambda e: problems.append(str(e)))
    phone.goto(f"{daemon.url}/dashboard")
    row = phone.locator("#prompt-cache tbody tr").first
    row.wait_for(timeout=WAIT_MS)
    with frozen(phone):  # locator.evaluate finds the row, then reads it: hold it still
        assert row.evaluate("e => getComputedStyle(e).display") == "grid"
    overflow = phone.evaluate(
        "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px on a phone"
    phone.evaluate("document.getElementById('prompt-cache').scrollIntoView()")
    _shot(phone, "dashboard-prompt-cache-phone.png", tmp_path)
    assert not problems, f"page errors: {problems}"
