"""The dashboard's operator panels in a real browser, at desktop and phone widths.

Memory (process RSS, MLX active/peak/cache, the weights' dtype and bytes),
latency percentiles over the last minutes, the KV/queue/throughput
sparklines, the instantaneous tok/s headline and the admins' log tail (with
a hostile message that must come out escaped); on a phone, the Running and
Waiting tables become cards and nothing scrolls sideways.
``MLXD_SCREENSHOT=1`` writes docs/img/dashboard-panels.png and
docs/img/dashboard-phone.png.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ROOT
from tests.support.browser import frozen
from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

HOSTILE = "<script>window.pwned=1</script>"
WAIT_MS = 20_000


def _config(model_dir: Path, **batch: Any) -> str:
    return toml_config(model={"path": str(model_dir)}, batch={"size": 2, **batch})


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    # Its own: a test writes a hostile key into its config.
    return daemons.get(_config(tiny_models("llama")), name="panels")


def _chat(
    d: Daemon, max_tokens: int, stream: bool = False, stop: threading.Event | None = None
) -> None:
    """One chat completion, read to its end (or until ``stop`` is set: the client leaves)."""
    body = {
        "model": d.model_id(),
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            if stop is not None and stop.is_set():
                break


def _busy(d: Daemon, n: int, max_tokens: int, stop: threading.Event) -> list[threading.Thread]:
    """``n`` long streams in the background: rows to show, a queue (batch size 2).

    They end when ``stop`` is set (the clients disconnect), not after all their tokens."""
    threads = [
        threading.Thread(target=_chat, args=(d, max_tokens, True, stop), daemon=True)
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    return threads


def _shot(page, name: str, tmp_path: Path, *, full_page: bool = True) -> Path:
    keep = os.environ.get("MLXD_SCREENSHOT") == "1"
    path = (ROOT / "docs" / "img" if keep else tmp_path) / name
    page.screenshot(path=str(path), full_page=full_page)
    assert path.stat().st_size > 10_000
    return path


def _text(page, selector: str) -> str:
    return page.locator(selector).inner_text().strip()


@pytest.mark.browser
def test_panels_at_desktop_and_phone_widths(daemon: Daemon, pages, tmp_path: Path) -> None:
    # Finished requests for the latency panel, and a warning whose text is hostile:
    # a rejected reload logs the unknown key, which the log tail must escape.
    for _ in range(3):
        _chat(daemon, 24)
    daemon.write_config(_config(tiny_model_dir("llama")) + f'"{HOSTILE}" = 1\n')
    assert daemon.reload().status_code == 400
    daemon.write_config(_config(tiny_model_dir("llama")))

    page = pages(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{daemon.url}/dashboard")
    page.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")

    with frozen(page):  # the regions poll: read one version of each
        # Memory: the process and MLX's allocator, the weights next to the KV budget.
        for field in ("rss", "mlx-active", "mlx-cache", "weights"):
            assert _text(page, f"#memory [data-field={field}]") not in ("", "—"), field
        assert _text(page, "#memory [data-field=dtype]") == "float32"
        # Latency over the last minutes, from the finished requests.
        for field in ("ttft-p50", "ttft-p95", "e2e-p50", "e2e-p95", "itl-p50", "itl-p95"):
            assert _text(page, f"#latency [data-field={field}]").endswith(" ms"), field
        assert "3 requests finished in the last 5 min" in _text(page, "#latency h2")
        # Sparklines: three server-rendered SVG lines.
        assert page.locator("#history figure.spark svg polyline").count() == 3
        assert page.locator("#history [data-spark=tps] polyline").get_attribute("points")
        # The log tail shows the warning as text, never as markup.
        tail = page.locator("#log-tail")
        assert HOSTILE in tail.inner_text() and "rejected" in tail.inner_text()
        assert tail.locator("script").count() == 0
        assert page.evaluate("window.pwned") is None

    stop = threading.Event()
    threads = _busy(daemon, 4, 1500, stop)
    page.locator("#active-rows tbody tr").first.wait_for(timeout=WAIT_MS)
    page.wait_for_function(
        "() => parseFloat(document.querySelector('[data-field=tps-now]').textContent) > 0",
        timeout=WAIT_MS,
    )
    _shot(page, "dashboard-panels.png", tmp_path)

    phone = pages(viewport={"width": 390, "height": 844}, device_scale_factor=2)
    phone.on("pageerror", lambda e: problems.append(str(e)))
    phone.goto(f"{daemon.url}/dashboard")
    row = phone.locator("#active-rows tbody tr").first
    row.wait_for(timeout=WAIT_MS)
    with frozen(phone):  # the running and waiting tables poll: hold them still to read
        assert row.evaluate("e => getComputedStyle(e).display") == "grid"
        head = phone.locator("#active-rows thead")
        assert head.evaluate("e => getComputedStyle(e).display") == "none"
        label = row.locator("td").first.evaluate("e => getComputedStyle(e, '::before').content")
        assert label == '"request"'
        waiting = phone.locator("#pending-queue tbody tr").first
        if waiting.count():
            assert waiting.evaluate("e => getComputedStyle(e).display") == "grid"
        overflow = phone.evaluate(
            "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, f"the page scrolls sideways by {overflow}px on a phone"
    # Issue 33: a menu of the panels, kept at the top of the view, jumps to any of them.
    phone.locator("#jump a[href='#prompt-cache']").click()
    phone.wait_for_function(
        "() => { const r = document.getElementById('prompt-cache').getBoundingClientRect();"
        " return r.top >= 0 && r.top < 120; }",
        timeout=WAIT_MS,
    )
    box = phone.locator("#jump").bounding_box()
    assert box is not None and abs(box["y"]) < 2, box  # still in view, at the top
    assert not page.locator("#jump").is_visible()  # a desktop has room for every panel
    # The screen an operator scrolls to: the running and waiting requests as cards.
    phone.evaluate("document.getElementById('active-rows').scrollIntoView()")
    _shot(phone, "dashboard-phone.png", tmp_path, full_page=False)

    stop.set()
    for t in threads:
        t.join(timeout=180)
    assert not problems, f"console errors: {problems}"
