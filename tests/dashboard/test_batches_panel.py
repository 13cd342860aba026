"""The dashboard's batches panel over HTTP: a running batch's progress, and its cancel button.

Bound off loopback with an admin token and anonymous reads, like the models
panel's tests: readers see the panel without buttons; the cancel button
needs the admin token, the CSRF token and a same-origin browser.
"""

from __future__ import annotations

import html
import io
import json
import re
import time

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config

ADMIN_TOKEN = "adm-batches-panel-token"
ADMIN = {"X-Mlxd-Admin-Token": ADMIN_TOKEN}


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    config = toml_config(
        server={"admin_token": ADMIN_TOKEN, "allow_anonymous_read": True},
        model={"path": str(tiny_models("llama")), "name": "tiny"},
        batch={"size": 2},
    )
    return daemons.get(config, name="batches-panel", args=["--host", "0.0.0.0"])


def _long_batch(d: Daemon) -> str:
    client = d.openai()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on."}]}
    lines = [
        {
            "custom_id": f"l{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "max_tokens": 400},
        }
        for i in range(50)
    ]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    upload = client.files.create(file=("p.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return batch.id


def _row(fragment: str, batch_id: str) -> str:
    m = re.search(rf'<tr data-batch="{batch_id}" data-status="(\w+)">(.*?)</tr>', fragment, re.S)
    assert m, fragment
    return m[0]


def _result(r: httpx.Response) -> str:
    m = re.search(r'<div id="batches-result"[^>]*data-outcome="(\w+)">(.*?)</div>', r.text, re.S)
    assert m, r.text
    return f"{m[1]}: {html.unescape(m[2])}"


def test_panel_shows_progress_and_cancels_for_admins_only(daemon: Daemon) -> None:
    batch_id = _long_batch(daemon)
    admin = httpx.Client(base_url=daemon.url, headers=ADMIN, timeout=60)
    page = admin.get("/dashboard")
    assert page.text.count('id="batches"') == 1 and 'id="batches-result"' in page.text
    token = admin.cookies["mlxd_csrf"]
    row = _row(admin.get("/dashboard/batches").text, batch_id)
    assert 'data-status="in_progress"' in row and 'role="progressbar"' in row
    assert re.search(r'data-field="total">50<', row) and 'data-action="cancel"' in row
    # A reader sees the batch, without the button.
    reader = _row(httpx.get(f"{daemon.url}/dashboard/batches").text, batch_id)
    assert "data-action" not in reader

    form = {"batch": batch_id}
    reader_client = httpx.Client(base_url=daemon.url, timeout=60)
    reader_client.get("/dashboard")
    anonymous = reader_client.post(
        "/dashboard/batches/cancel",
        data=form,
        headers={"HX-Request": "true", "X-CSRF-Token": reader_client.cookies["mlxd_csrf"]},
    )
    assert anonymous.status_code == 401 and "admin token" in _result(anonymous)
    no_csrf = admin.post("/dashboard/batches/cancel", data=form, headers={"HX-Request": "true"})
    assert no_csrf.status_code == 403 and "CSRF" in _result(no_csrf)
    hx = {"X-CSRF-Token": token, "HX-Request": "true"}
    cross = admin.post(
        "/dashboard/batches/cancel", data=form, headers={**hx, "Origin": "http://evil.example"}
    )
    assert cross.status_code == 403
    unknown = admin.post("/dashboard/batches/cancel", data={"batch": "batch_nope"}, headers=hx)
    assert unknown.status_code == 404 and "no open batch" in _result(unknown)
    assert daemon.openai().batches.retrieve(batch_id).status == "in_progress"

    done = admin.post("/dashboard/batches/cancel", data=form, headers=hx)
    assert done.status_code == 200 and _result(done).startswith("done:")
    assert 'hx-swap-oob="true"' in done.text  # the panel, fresh
    deadline = time.monotonic() + 60
    while (status := daemon.openai().batches.retrieve(batch_id).status) != "cancelled":
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
    row = _row(admin.get("/dashboard/batches").text, batch_id)
    assert 'data-status="cancelled"' in row and "data-action" not in row


@pytest.mark.browser
def test_cancel_in_a_browser(daemon: Daemon, pages) -> None:
    batch_id = _long_batch(daemon)
    page = pages(extra_http_headers=ADMIN, viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{daemon.url}/dashboard")
    page.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")
    row = page.locator(f'#batches tr[data-batch="{batch_id}"]')
    row.locator('[role="progressbar"]').wait_for(timeout=30_000)
    row.locator('button[data-action="cancel"]').click()
    page.locator('#batches-result[data-outcome="done"]').wait_for(timeout=30_000)
    assert page.locator("#batches-result").inner_text() == f"{batch_id} is cancelling"
    page.locator(f'#batches tr[data-batch="{batch_id}"][data-status="cancelled"]').wait_for(
        timeout=60_000
    )
    assert not problems, problems
