"""Admission never wedges a model (issue 20): a cache hit that would never fit, a
reload that shrinks the budget below a queued request, and a request stuck for
any other reason (an injected admission bug) each leave the daemon serving the
next request; a stall shows in /stats, /ready and the dashboard."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from mlxd.control import status_lines
from tests.support.daemon import Daemon, toml_config

WORDS = "the cat sat on the mat " * 200


def base(llama: str, **batch: Any) -> dict[str, Any]:
    return {
        "model": {"path": llama, "max_context": 512},
        "batch": {"size": 4, **batch},
        "sampling": {"temperature": 0.0},
    }


@pytest.fixture(scope="module")
def llama(tiny_models) -> str:
    return str(tiny_models("llama"))


@pytest.fixture(scope="module")
def daemon(apps, llama):
    return apps.get(base(llama), name="admission", env={"MLXD_FAULT_INJECTION": "1"})


@pytest.fixture
def configured(daemon, llama):
    """Reload the daemon with ``[batch]`` keys; back to the defaults afterwards."""

    def apply(**batch: Any) -> None:
        daemon.write_config(toml_config(**base(llama, **batch)))
        assert daemon.reload().json()["outcome"] in ("applied", "unchanged")

    yield apply
    apply()


def complete(daemon: Daemon, prompt: str, max_tokens: int, **kw: Any) -> httpx.Response:
    body = {"model": daemon.model_id(), "prompt": prompt, "max_tokens": max_tokens, **kw}
    return httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=60)


def test_a_cache_hit_that_would_never_fit_is_replanned_and_the_model_serves_on(daemon, configured):
    # The recipe: fill the prompt cache with ~490 tokens, shrink the budget to
    # 600 slots (1 KiB each on the tiny llama), then a 401-token prompt sharing 400 of
    # them: with the hit its cache needs 400 + 256 slots, without it 512.
    filled = complete(daemon, WORDS[:1200], 20)
    assert filled.status_code == 200, filled.text
    configured(kv_budget="600KiB", decode_allowance=64)
    r = complete(daemon, WORDS[:1020], 60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 300
    # The hit was cut back to the last 256-token boundary, not dropped.
    assert usage["prompt_tokens_details"]["cached_tokens"] == 256
    assert complete(daemon, "hello there", 10).status_code == 200
    stats = daemon.stats()
    assert stats["pending"] == [] and stats["stalled"] is False
    assert httpx.get(f"{daemon.url}/ready").status_code == 200


def test_a_reload_below_a_queued_request_refuses_it_at_once(daemon, configured):
    # The running row (2 + 64 tokens) alone: 256 slots; the queued one (about 320 + 64)
    # alone: 512, with the running one 2 x (384 + 255) > 600.
    configured(kv_budget="600KiB", decode_allowance=64)
    model = daemon.model_id()
    running: dict[str, Any] = {}

    def stream_long() -> None:
        body = {"model": model, "prompt": "one two", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{daemon.url}/v1/completions", json=body, timeout=60) as r:
            running["events"] = sum(1 for line in r.iter_lines() if line.startswith("data: "))
            running["done_at"] = time.monotonic()

    long = threading.Thread(target=stream_long)
    long.start()
    try:
        deadline = time.monotonic() + 30
        while not daemon.stats()["rows"] and time.monotonic() < deadline:
            time.sleep(0.02)
        queued: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: queued.update(r=complete(daemon, WORDS[:800], 100), at=time.monotonic())
        )
        waiter.start()
        while not daemon.stats()["pending"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.stats()["pending"][0]["waiting_for"] == "budget"
        # 300 KiB can never hold the queued request; the running row goes on.
        configured(kv_budget="300KiB", decode_allowance=64)
        waiter.join(30)
        r = queued["r"]
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_over_budget"
        assert "[batch] kv_budget (300 KiB)" in error["message"]
        assert "while this request waited" in error["message"]
    finally:
        long.join(60)
    assert queued["at"] < running["done_at"]  # refused while the running row still ran
    assert running["events"] > 100  # the running row was never dropped
    assert complete(daemon, "hello", 5).status_code == 200


def test_a_stalled_request_shows_in_stats_ready_and_the_dashboard_and_blocks_nobody(daemon):
    model = daemon.model_id()
    stuck: dict[str, str] = {}
    release = threading.Event()

    def stream_stuck() -> None:
        body = json.dumps(
            {
                "model": model,
                "prompt": "stuck",
                "max_tokens": 5,
                "stream": True,
                "mlxd_fault": "never_admit",
            }
        ).encode()
        # A stream's headers come at admission, which never comes: a raw socket
        # sends the request and closing it cancels the request (its id is read
        # from /stats).
        host, port = daemon.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (f"{host}:{port}".encode(), len(body), body)
            )
            release.wait(60)

    client = threading.Thread(target=stream_stuck)
    client.start()
    try:
        deadline = time.monotonic() + 30
        stats = daemon.stats()
        while not stats["stalled"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = daemon.stats()
        assert stats["stalled"] is True
        reason = stats["stalled_reason"]
        stuck["id"] = stats["pending"][0]["id"]
        assert stuck["id"] in reason and "waits for budget while the batch is idle" in reason
        assert [p["waiting_for"] for p in stats["pending"]] == ["stalled"]
        model_row = next(m for m in stats["fleet"]["models"] if m["id"] == model)
        assert model_row["engine"]["stalled_reason"] == reason
        ready = httpx.get(f"{daemon.url}/ready")
        assert ready.status_code == 503
        assert ready.json()["reason"] == f"engine {model} stalled: {reason}"
        bar = httpx.get(f"{daemon.url}/dashboard/status-bar").text
        assert 'data-field="stalled"' in bar and stuck["id"] in bar
        lines, code = status_lines(daemon.url, stats)  # what `mlxd status` prints
        assert f"  stalled: {reason}" in lines and code == 1
        # Requests behind the stalled one are admitted past it.
        assert complete(daemon, "hello", 5).status_code == 200
    finally:
        release.set()
        client.join(30)
    deadline = time.monotonic() + 30
    while daemon.stats()["stalled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.stats()["stalled"] is False
    assert httpx.get(f"{daemon.url}/ready").status_code == 200
