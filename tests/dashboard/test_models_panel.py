"""The dashboard's models panel and /metrics' ``model`` label, against the real daemon.

One daemon serves two tiny random-weight chat models under a 64 MiB budget:
``a`` (pinned, the default) and ``org/b`` (an id with a ``/``, loaded on
demand); a third, ``big``, reserves a prompt cache larger than the budget. It
is bound off loopback (``--host 0.0.0.0``, reached via 127.0.0.1) with an admin
token and anonymous read, so the panel is readable by anyone and its buttons
are for the admin only. Every write shows its credentials: the admin header,
the CSRF cookie and its token.

The tests run in file order and share the daemon's state: the panel first
(``org/b`` unloaded), then the refusals (nothing changes), then the actions,
then /metrics after a request to each model, then a real browser.
``MLXD_SCREENSHOT=1`` writes the panel to docs/img/dashboard-models.png.
"""

from __future__ import annotations

import html
import os
import re
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT
from tests.support.daemon import Daemon, toml_config

ADMIN_TOKEN = "adm-models-panel-token"
ADMIN = {"X-Mlxd-Admin-Token": ADMIN_TOKEN}
A, B, BIG = "a", "org/b", "big"
MIB = 1024 * 1024
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    small = {"prompt_cache": {"max_bytes": "1MiB"}, "batch": {"size": 2, "kv_budget": "8MiB"}}
    config = toml_config(
        server={"admin_token": ADMIN_TOKEN, "allow_anonymous_read": True},
        memory={"budget": "64MiB"},
        models={
            A: {"path": str(tiny_models("llama")), "pin": True, "default": True, **small},
            B: {"path": str(tiny_models("llama", seed=1)), **small},
            # Its prompt cache's cap alone is more than the budget: it can never load.
            BIG: {"path": str(tiny_models("llama")), "prompt_cache": {"max_bytes": "96MiB"}},
        },
        sampling={"temperature": 0.0},
    )
    # Its own: the tests load and unload its models in file order.
    return daemons.get(config, name="models-panel", args=["--host", "0.0.0.0"])


class Panel:
    """A browser-like client of the panel: admin header, the CSRF cookie and its token."""

    def __init__(self, d: Daemon, headers: dict[str, str] | None = None):
        self.client = httpx.Client(
            base_url=d.url, headers=ADMIN if headers is None else headers, timeout=120
        )
        self.token = ""

    def load(self) -> str:
        page = self.client.get("/dashboard")
        assert page.status_code == 200, page.text
        field = re.search(r'name="_csrf_token" value="([^"]+)"', page.text)
        # No buttons, no field (a reader): the double-submit token is the cookie's value.
        self.token = field[1] if field else self.client.cookies["mlxd_csrf"]
        assert self.token == self.client.cookies["mlxd_csrf"]
        return page.text

    def post(self, action: str, headers: dict[str, str] | None = None, **form: str):
        hx = {"X-CSRF-Token": self.token, "HX-Request": "true", **(headers or {})}
        return self.client.post(f"/dashboard/models/{action}", data=form, headers=hx)


def _rows(fragment: str) -> dict[str, dict[str, str]]:
    """Each model row of the panel: its state, pinned flag and buttons."""
    rows = {}
    for m in re.finditer(
        r'<tr data-model="([^"]+)" data-state="(\w+)" data-pinned="(\w+)">(.*?)</tr>',
        fragment,
        re.S,
    ):
        buttons = re.findall(r'data-action="(\w+)"', m[4])
        rows[html.unescape(m[1])] = {"state": m[2], "pinned": m[3], "buttons": buttons}
    return rows


def _panel(d: Daemon, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{d.url}/dashboard/models", headers=ADMIN if headers is None else headers)
    assert r.status_code == 200, r.text
    return _rows(r.text)


def _result(r: httpx.Response) -> str:
    m = re.search(r'<div id="models-result"[^>]*data-outcome="(\w+)">(.*?)</div>', r.text, re.S)
    assert m, r.text
    return f"{m[1]}: {html.unescape(m[2])}"


# ---------------------------------------------------------------- the panel


def test_panel_shows_both_models_and_their_states(daemon: Daemon) -> None:
    rows = _panel(daemon)
    assert set(rows) == {A, B, BIG}
    assert rows[A]["state"] == "loaded" and rows[A]["pinned"] == "true"
    assert rows[B]["state"] == "unloaded" and rows[B]["pinned"] == "false"
    # An admin's buttons: a pinned model can be unpinned (not unloaded); b can be loaded.
    assert rows[A]["buttons"] == ["unpin"]
    assert rows[B]["buttons"] == ["load", "pin"]
    fragment = httpx.get(f"{daemon.url}/dashboard/models", headers=ADMIN).text
    assert 'data-field="memory-budget">64.0 MiB<' in fragment
    assert re.search(r'class="seg seg-weights" style="width: [\d.]+%"', fragment)
    assert "loaded" in re.search(r'<ol class="events model-events">(.*?)</ol>', fragment, re.S)[1]
    page = httpx.get(f"{daemon.url}/dashboard", headers=ADMIN).text
    assert page.count('id="models"') == 1 and 'id="models-result"' in page


def test_anonymous_readers_see_the_panel_without_buttons(daemon: Daemon) -> None:
    rows = _panel(daemon, headers={})
    assert set(rows) == {A, B, BIG} and all(not r["buttons"] for r in rows.values())


# ---------------------------------------------------------------- refusals


def test_writes_need_the_admin_token(daemon: Daemon) -> None:
    anonymous = Panel(daemon, headers={})
    anonymous.load()
    r = anonymous.post("load", model=B)
    assert r.status_code == 401 and "admin token required" in _result(r)
    assert r.headers["x-mlxd-outcome"] == "refused"
    assert 'data-action="' not in r.text  # the panel it sends back has no buttons
    assert _panel(daemon)[B]["state"] == "unloaded"


def test_writes_need_the_csrf_token(daemon: Daemon) -> None:
    panel = Panel(daemon)
    panel.load()
    no_token = panel.client.post(
        "/dashboard/models/load", data={"model": B}, headers={"HX-Request": "true"}
    )
    assert no_token.status_code == 403 and "CSRF" in _result(no_token)
    forged = panel.post("load", headers={"X-CSRF-Token": "0" * 128}, model=B)
    assert forged.status_code == 403 and "CSRF" in _result(forged)
    # A plain form post (no htmx) with a forged field is refused too, as a page.
    plain = panel.client.post("/dashboard/models/load", data={"model": B, "_csrf_token": "f" * 128})
    assert plain.status_code == 403 and "<html" in plain.text and "CSRF" in plain.text
    cross = panel.post("load", headers={"Origin": "http://evil.example"}, model=B)
    assert cross.status_code == 403 and "cross-site" in _result(cross)
    assert _panel(daemon)[B]["state"] == "unloaded"


def test_bad_forms_get_a_clear_4xx(daemon: Daemon) -> None:
    panel = Panel(daemon)
    panel.load()
    unknown = panel.post("load", model="org/nope")
    assert unknown.status_code == 404
    assert "no model 'org/nope' is configured" in _result(unknown) and B in _result(unknown)
    missing = panel.post("load")
    assert missing.status_code == 400 and "names no model" in _result(missing)
    too_long = panel.post("load", model="x" * 300)
    assert too_long.status_code == 400
    bad_on = panel.post("pin", model=B, on="maybe")
    assert bad_on.status_code == 400 and "true or false" in _result(bad_on)
    assert panel.client.get("/dashboard/models/load").status_code in (404, 405)
    # The fleet's refusal, in its status: a model that can never fit the budget.
    never = panel.post("load", model=BIG)
    assert never.status_code == 400 and "can never be loaded" in _result(never)
    assert _rows(never.text)[BIG]["state"] != "loaded"
    assert _panel(daemon)[B] == {"state": "unloaded", "pinned": "false", "buttons": ["load", "pin"]}


# ---------------------------------------------------------------- actions


def test_load_pin_and_unload_over_forms(daemon: Daemon) -> None:
    panel = Panel(daemon)
    panel.load()
    r = panel.post("load", model=B)
    assert r.status_code == 200 and _result(r) == f"done: {B} is loaded"
    # The answer carries the panel, fresh, for an out-of-band swap.
    assert 'hx-swap-oob="true"' in r.text and _rows(r.text)[B]["state"] == "loaded"
    assert _panel(daemon)[B]["buttons"] == ["unload", "pin"]

    r = panel.post("pin", model=B, on="true")
    assert r.status_code == 200 and _result(r) == f"done: {B} is pinned"
    assert _panel(daemon)[B]["pinned"] == "true"
    # The fleet refuses to unload a pinned model: its message, its status, no 500.
    refused = panel.post("unload", model=B)
    assert refused.status_code == 409 and "pinned" in _result(refused)
    assert refused.headers["x-mlxd-outcome"] == "refused"
    assert _panel(daemon)[B]["state"] == "loaded"

    assert panel.post("pin", model=B, on="false").status_code == 200
    r = panel.post("unload", model=B)
    assert r.status_code == 200 and _result(r) == f"done: {B} is unloaded"
    assert _panel(daemon)[B] == {"state": "unloaded", "pinned": "false", "buttons": ["load", "pin"]}
    # The panel's events, newest first.
    events = re.findall(r'data-kind="(\w+)" data-model="([^"]+)"', r.text)
    assert [(html.unescape(m), k) for k, m in events][:4] == [
        (B, "unloaded"), (B, "unpinned"), (B, "pinned"), (B, "loaded")
    ]  # fmt: skip
    # The server's log says so too, as it does for loads and unloads (issue 22).
    log = daemon.log()
    assert f"model {B} pinned (by an admin)" in log and f"model {B} unpinned (by an admin)" in log


# ---------------------------------------------------------------- /metrics


def _chat(d: Daemon, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def _samples(d: Daemon) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{d.url}/metrics", headers=ADMIN, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_carry_the_model_label(daemon: Daemon) -> None:
    before = _samples(daemon)
    for model in (A, B):  # b is unloaded: its request loads it
        _chat(daemon, model)
    after = _samples(daemon)
    for model in (A, B):
        done = "mlxd_request_duration_seconds_count"
        assert _value(after, done, model=model, lane="batch") == (
            _value(before, done, model=model, lane="batch") + 1
        )
        assert _value(after, "mlxd_requests_total", model=model, lane="batch", outcome="completed")
        assert _value(after, "mlxd_model_loaded", model=model) == 1
        assert _value(after, "mlxd_model_weights_bytes", model=model) > 0
        assert _value(after, "mlxd_kv_budget_bytes", model=model) > 0
        info = _info_labels(after, model)
        assert info["status"] == "ready" and info["mode"] == "batch", info
    assert _value(after, "mlxd_memory_budget_bytes") == 64 * MIB
    used = _value(after, "mlxd_memory_used_bytes")
    assert 0 < used <= 64 * MIB
    assert used >= sum(_value(after, "mlxd_model_reserved_bytes", model=m) for m in (A, B))
    # b was loaded (by the admin, then by the request) and unloaded once.
    assert _value(after, "mlxd_model_events_total", model=B, kind="loaded") == 2
    assert _value(after, "mlxd_model_events_total", model=B, kind="unloaded") == 1
    assert _value(after, "mlxd_model_state", model=B, state="loaded") == 1
    assert _value(after, "mlxd_model_state", model=B, state="unloaded") == 0


def _info_labels(samples: dict, model: str) -> dict[str, str]:
    for (name, labels), value in samples.items():
        found = dict(labels)
        if name == "mlxd_model_info" and found.get("model") == model and value == 1:
            return found
    raise AssertionError(f"no mlxd_model_info for {model}")


# ---------------------------------------------------------------- browser


@pytest.mark.browser
def test_unload_and_load_in_a_browser(daemon: Daemon, pages) -> None:
    page = pages(extra_http_headers=ADMIN, viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{daemon.url}/dashboard")
    page.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")
    row = page.locator(f'#models tr[data-model="{B}"]')
    assert row.get_attribute("data-state") == "loaded"  # the request above loaded it

    row.locator('button[data-action="unload"]').click()
    page.locator('#models-result[data-outcome="done"]').wait_for(timeout=WAIT_MS)
    assert page.locator("#models-result").inner_text() == f"{B} is unloaded"
    page.locator(f'#models tr[data-model="{B}"][data-state="unloaded"]').wait_for(timeout=WAIT_MS)

    # A refusal shows its message in the panel: unloading the pinned model.
    page.evaluate(
        "document.getElementById('models-result').setAttribute('data-outcome', 'pending')"
    )
    page.evaluate(
        """id => htmx.ajax('POST', '/dashboard/models/unload',
             {source: '#models-result', target: '#models-result', swap: 'outerHTML',
              values: {model: id, _csrf_token:
                document.querySelector('#models input[name=_csrf_token]').value}})""",
        A,
    )
    page.locator('#models-result[data-outcome="refused"]').wait_for(timeout=WAIT_MS)
    assert "pinned" in page.locator("#models-result").inner_text()

    page.locator(f'#models tr[data-model="{B}"] button[data-action="load"]').click()
    page.locator(f'#models tr[data-model="{B}"][data-state="loaded"]').wait_for(timeout=WAIT_MS)
    page.locator('#models-result[data-outcome="done"]').wait_for(timeout=WAIT_MS)
    assert page.locator("#models-result").inner_text() == f"{B} is loaded"
    assert page.locator("#models .gauge.stack .seg").count() >= 2
    if os.environ.get("MLXD_SCREENSHOT") == "1":
        shot = ROOT / "docs" / "img" / "dashboard-models.png"
        page.locator(".models-panel").screenshot(path=str(shot))
    # The browser logs the refusal's status; nothing else may go wrong.
    refusal = "the server responded with a status of 409"
    assert sum(refusal in p for p in problems) == 1, problems
    assert not [p for p in problems if refusal not in p], problems
