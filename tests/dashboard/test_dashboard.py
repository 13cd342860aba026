"""The dashboard against the real daemon: partial structure, access, and a real browser.

The browser test opens the page while the daemon serves concurrent requests and
watches it breathe: rows fill and empty, the KV gauge moves, a seeded request
drains the batch and the drain (and a reload) show up in the event log, with
no console errors. ``MLXD_SCREENSHOT=1`` writes the busy page to
docs/img/dashboard.png.

Chromium comes from the system (``/usr/bin/chromium``, or ``$MLXD_CHROMIUM``);
without it the browser tests skip, unless ``MLXD_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.api.http.access import COOKIE, cookie_value
from mlxd.dashboard.regions import REGIONS
from tests.support import ROOT
from tests.support.browser import frozen
from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

PARTIALS = ROOT / "templates" / "partials"
ADMIN_TOKEN = "adm-dashboard-test-token"
API_KEY = "sk-dashboard-test-key"
HOSTILE_NAME = 'tiny"><script>alert(1)</script>'


# MLXD_DASHBOARD_MODEL=demo runs this module on the real demo model (slower: for
# the screenshot); the default is the tiny random-weight llama.
DEMO = os.environ.get("MLXD_DASHBOARD_MODEL") == "demo"
pytestmark = [pytest.mark.slow] if DEMO else []
LONG, SHORT, PATIENCE = (48, 12, 4.0) if DEMO else (1500, 40, 1.0)


def _config(name: str | None = None, **server: Any) -> str:
    model: dict[str, str] = {} if DEMO else {"path": str(tiny_model_dir("llama"))}
    if name:
        model["name"] = name
    return toml_config(
        server=server,
        model=model,
        batch={"size": 2, "kv_budget": "512MiB" if DEMO else "16MiB"},
    )


def _ms(seconds: float) -> float:
    return seconds * 1000 * PATIENCE


@pytest.fixture(scope="module")
def daemon(daemons):
    # Its own: the browser test counts its finished requests and sends it SIGHUP.
    return daemons.get(_config(), name="dashboard")


@pytest.fixture(scope="module")
def guarded(daemons):
    """Bound off loopback with an admin token and a /v1 API key."""
    return daemons.get(_config(host="0.0.0.0", admin_token=ADMIN_TOKEN, api_keys=[API_KEY]))


@pytest.fixture(scope="module")
def anonymous(daemons):
    # A model name an operator typed, rendered in the page: it must come out escaped.
    return daemons.get(_config(name=HOSTILE_NAME, host="0.0.0.0", allow_anonymous_read=True))


# ---------------------------------------------------------------- HTML helpers


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}


class Outline(HTMLParser):
    """Top-level elements, and every element with an id, of an HTML fragment."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.roots: list[tuple[str, dict[str, str | None]]] = []
        self.ids: list[tuple[str, dict[str, str | None]]] = []
        self.text_at_root = ""

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        if self.depth == 0:
            self.roots.append((tag, attributes))
        if attributes.get("id"):
            self.ids.append((tag, attributes))
        if tag not in VOID:
            self.depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag not in VOID:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth == 0:
            self.text_at_root += data.strip()


def outline(html: str) -> Outline:
    parser = Outline()
    parser.feed(html)
    parser.close()
    return parser


# ---------------------------------------------------------------- structure


def test_every_partial_is_its_own_route(daemon: Daemon) -> None:
    names = sorted(p.stem for p in PARTIALS.glob("*.html"))
    assert names == sorted(REGIONS), "templates/partials and regions.REGIONS disagree"
    page = outline(httpx.get(f"{daemon.url}/dashboard").text)
    page_ids = {attrs["id"]: attrs for _, attrs in page.ids}
    for name in names:
        r = httpx.get(f"{daemon.url}/dashboard/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"].startswith("text/html")
        fragment = outline(r.text)
        assert len(fragment.roots) == 1 and not fragment.text_at_root, (
            f"/dashboard/{name} must answer exactly one root element"
        )
        _, attrs = fragment.roots[0]
        assert attrs.get("id") == name
        assert attrs.get("hx-get") == f"/dashboard/{name}"
        assert attrs.get("hx-target") == "this"
        assert attrs.get("hx-swap") == "outerHTML"
        assert re.fullmatch(r"every [12]s", attrs.get("hx-trigger") or ""), attrs
        # The page includes the same partial: same root, same polling.
        assert sum(1 for _, a in page.ids if a["id"] == name) == 1
        assert page_ids[name] == attrs


def test_page_works_without_javascript_and_offline(daemon: Daemon) -> None:
    root = httpx.get(f"{daemon.url}/", follow_redirects=False)
    assert root.status_code in (301, 302, 303, 307) and root.headers["location"] == "/dashboard"
    html = httpx.get(f"{daemon.url}/dashboard").text
    assert re.search(r'<noscript><meta http-equiv="refresh" content="\d+"></noscript>', html)
    assert 'href="/dashboard/config"' in html  # room for the config editor
    links = re.findall(r'(?:src|href)="([^"]*)"', html)
    # no CDN (a "#panel" link is the phone's jump menu, on this page)
    assert links and all(u.startswith(("/", "data:", "#")) for u in links), links
    vendored = (ROOT / "static" / "VENDORED.md").read_text()
    htmx = httpx.get(f"{daemon.url}/static/htmx.min.js")
    assert htmx.status_code == 200
    assert hashlib.sha256(htmx.content).hexdigest() in vendored
    assert re.search(r'version:"2\.0\.\d+"', htmx.text)
    assert httpx.get(f"{daemon.url}/static/mlxd.css").status_code == 200
    assert httpx.get(f"{daemon.url}/dashboard/nonexistent-region").status_code == 404


# ---------------------------------------------------------------- access


def test_off_loopback_reading_needs_the_admin_token(guarded: Daemon) -> None:
    url = guarded.url
    page = httpx.get(f"{url}/dashboard", follow_redirects=False)
    assert page.status_code == 303
    assert page.headers["location"] == "/dashboard/login?next=/dashboard"
    poll = httpx.get(f"{url}/dashboard/kv-gauge", headers={"HX-Request": "true"})
    assert poll.headers["hx-redirect"].startswith("/dashboard/login")
    assert "kv-gauge" not in poll.text
    for path in ("/stats", "/metrics"):
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "admin_token_required"
        # A /v1 API key is not an admin token.
        assert (
            httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}).status_code
            == 401
        )
        assert (
            httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        bearer = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert httpx.get(f"{url}{path}", headers=bearer).status_code == 200
        header = {"X-Mlxd-Admin-Token": ADMIN_TOKEN}
        assert httpx.get(f"{url}{path}", headers=header).status_code == 200
    bearer = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.get(f"{url}/dashboard", headers=bearer).status_code == 200
    assert httpx.get(f"{url}/dashboard/counters", headers=bearer).status_code == 200


def test_login_form_sets_the_session_cookie(guarded: Daemon) -> None:
    with httpx.Client(base_url=guarded.url) as client:
        form = client.get("/dashboard/login", params={"next": "/dashboard"})
        assert form.status_code == 200 and 'name="token"' in form.text
        wrong = client.post("/dashboard/login", data={"token": "nope", "next": "/dashboard"})
        assert wrong.status_code == 401
        assert "wrong token" in wrong.text and 'name="token"' in wrong.text
        assert "set-cookie" not in wrong.headers
        assert client.get("/dashboard", follow_redirects=False).status_code == 303
        ok = client.post("/dashboard/login", data={"token": ADMIN_TOKEN, "next": "/dashboard"})
        assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
        cookie = ok.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}={cookie_value(ADMIN_TOKEN)};")
        assert ADMIN_TOKEN not in cookie
        assert "HttpOnly" in cookie and re.search(r"SameSite=strict", cookie, re.I)
        assert "Path=/" in cookie
        page = client.get("/dashboard")
        assert page.status_code == 200 and 'id="active-rows"' in page.text
        assert client.get("/stats").status_code == 200  # the cookie opens /stats too
    # After login, only dashboard paths on this server are followed.
    evil = httpx.post(
        f"{guarded.url}/dashboard/login", data={"token": ADMIN_TOKEN, "next": "//evil.example/x"}
    )
    assert evil.headers["location"] == "/dashboard"


def test_anonymous_read_opens_reading(anonymous: Daemon) -> None:
    for path in ("/stats", "/metrics", "/dashboard", "/dashboard/active-rows"):
        assert httpx.get(f"{anonymous.url}{path}", follow_redirects=False).status_code == 200, path


def test_user_supplied_text_is_escaped(anonymous: Daemon) -> None:
    for path in ("/dashboard", "/dashboard/status-bar"):
        html = httpx.get(f"{anonymous.url}{path}").text
        assert "<script>alert(1)" not in html, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, path


def test_the_log_tail_is_for_admins_only(anonymous: Daemon, daemon: Daemon) -> None:
    # Off loopback, anonymous read: the page shows, the log tail does not.
    html = httpx.get(f"{anonymous.url}/dashboard/log-tail").text
    assert "for admins" in html and 'class="log"' not in html
    # On loopback the reader is an admin.
    assert "for admins" not in httpx.get(f"{daemon.url}/dashboard/log-tail").text


def test_off_loopback_without_admin_token_is_loud(anonymous: Daemon, daemon: Daemon) -> None:
    # Bound to 0.0.0.0 without an admin token: a warning in the log, a banner on the page.
    page = httpx.get(f"{anonymous.url}/dashboard", timeout=10)
    assert page.status_code == 200
    assert "SECURITY: mlxd is bound to 0.0.0.0" in anonymous.log()
    assert 'id="exposure-banner"' in page.text and "/v1 is open to anyone" in page.text
    # On loopback, neither.
    page = httpx.get(f"{daemon.url}/dashboard", timeout=10)
    assert page.status_code == 200
    assert "SECURITY: mlxd is bound" not in daemon.log()
    assert 'id="exposure-banner"' not in page.text


# ---------------------------------------------------------------- browser


def _stream(d: Daemon, content: str, max_tokens: int, **extra: Any) -> None:
    body = {
        "model": d.model_id(),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        **extra,
    }
    with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass


def _background(errors: list[str], fn, *args: Any, **kw: Any) -> threading.Thread:
    def run() -> None:
        try:
            fn(*args, **kw)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(repr(exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _batch_row_running(d: Daemon) -> bool:
    return any(r["lane"] == "batch" for r in d.stats()["rows"])


def _warm_up_chart(d: Daemon) -> None:
    """For the screenshot: some finished requests and a bar or two in the throughput chart."""
    errors: list[str] = []
    for thread in [_background(errors, _stream, d, f"Warm up {i}.", SHORT) for i in range(2)]:
        thread.join(timeout=120 * PATIENCE)
    assert not errors, errors
    deadline = time.monotonic() + 10
    while not any(d.stats()["throughput"]["series"][:-1]) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.browser
def test_dashboard_breathes_under_load(daemon: Daemon, pages, tmp_path: Path) -> None:
    screenshot = os.environ.get("MLXD_SCREENSHOT") == "1"
    if screenshot:
        _warm_up_chart(daemon)
    page = pages(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{daemon.url}/dashboard")
    page.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")
    with frozen(page):  # the regions poll: read one version of each
        assert page.locator("[data-field=kv-live]").inner_text() == "0 B"
        assert page.locator("#active-rows .empty").is_visible()
    finished = daemon.stats()["counters"]["finished"]

    errors: list[str] = []
    clients = [
        _background(errors, _stream, daemon, f"Tell me about river {i}. " * 4, LONG)
        for i in range(4)
    ]
    rows = page.locator("#active-rows tbody tr")
    rows.first.wait_for(timeout=_ms(20))
    page.wait_for_function(
        "() => document.querySelector('[data-field=kv-live]').textContent.trim() !== '0 B'",
        timeout=_ms(10),
    )
    with frozen(page):  # locator.evaluate finds the bar, then reads it: hold it still
        width = page.locator("#kv-gauge .bar.live").evaluate("e => parseFloat(e.style.width)")
    assert width > 0, "the KV gauge bar did not move"

    assert _batch_row_running(daemon), "the batch finished before the seeded request was sent"
    clients.append(_background(errors, _stream, daemon, "A seeded one.", SHORT, seed=11))
    daemon.signal(signal.SIGHUP)  # a reload event, shown next to the drains
    page.locator("#event-log [data-kind=drain]").first.wait_for(timeout=_ms(20))
    page.locator("#event-log [data-kind=reload]").first.wait_for(timeout=_ms(10))
    assert "seed" in page.locator("#event-log [data-kind=drain]").first.inner_text()
    shot = ROOT / "docs" / "img" / "dashboard.png" if screenshot else tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    page.wait_for_function(
        "() => parseFloat(document.querySelector('[data-field=tps]').textContent) > 0",
        timeout=_ms(15),
    )

    for thread in clients:
        thread.join(timeout=120 * PATIENCE)
    assert not errors, errors
    page.locator("#active-rows .empty").wait_for(timeout=_ms(15))
    page.locator("#pending-queue .empty").wait_for(timeout=_ms(5))
    page.wait_for_function(
        "() => document.querySelector('[data-field=kv-live]').textContent.trim() === '0 B'",
        timeout=_ms(5),
    )
    page.wait_for_function(
        f"() => document.querySelector('#counters [data-field=finished]').textContent === "
        f"'{finished + 5}'",
        timeout=_ms(5),
    )
    assert shot.stat().st_size > 10_000
    assert not problems, f"console errors: {problems}"


@pytest.mark.browser
def test_login_in_a_browser(guarded: Daemon, pages) -> None:
    page = pages()
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{guarded.url}/dashboard")
    assert "/dashboard/login" in page.url
    page.fill("#token", "wrong")
    page.click("button[type=submit]")
    assert page.locator(".error").inner_text() == "wrong token"
    page.fill("#token", ADMIN_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{guarded.url}/dashboard")
    uptime = page.locator("[data-field=uptime]")
    first = uptime.inner_text()
    # The polls carry the cookie: the status bar refreshes itself.
    page.wait_for_function(
        f"() => document.querySelector('[data-field=uptime]').textContent !== {first!r}",
        timeout=10_000,
    )
    assert COOKIE not in page.evaluate("document.cookie")  # HttpOnly
    assert not problems, problems
