"""Stopping like a service: SIGTERM drains with a timeout, new requests get 503,
the process exits 0; a second signal exits at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config


@pytest.fixture
def start(tmp_path, tiny_models):
    """Start a daemon with a given shutdown_timeout; always stopped at the end."""
    started = []

    def run(timeout_s):
        text = toml_config(
            model={"path": str(tiny_models("llama"))},
            batch={"size": 4},
            server={"shutdown_timeout": timeout_s},
            sampling={"temperature": 0.0},
        )
        started.append(Daemon(tmp_path, text).start())
        return started[-1]

    yield run
    for d in started:
        d.stop()


def stream_in_thread(
    d: Daemon, max_tokens: int, out: dict, key: str, started: threading.Event | None = None
):
    def run():
        body = {
            "model": d.model_id(),
            "messages": [{"role": "user", "content": key}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        events = []
        try:
            with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=body, timeout=120) as r:
                out[key + ":status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if started is not None:
                            started.set()
        except httpx.HTTPError as exc:
            out[key + ":error"] = repr(exc)
        out[key] = events

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_shutting_down(d: Daemon, timeout: float = 20.0) -> httpx.Response:
    """Wait until /ready stops saying 200 (the daemon handled its SIGTERM); that answer."""
    deadline = time.monotonic() + timeout
    while (ready := httpx.get(f"{d.url}/ready", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "the SIGTERM was never handled"
        time.sleep(0.02)
    return ready


def _pace(d: Daemon, seconds: float = 0.5) -> float:
    """Tokens per second of the one running row, measured over ``seconds``."""
    (before,) = d.stats()["rows"]
    started = time.monotonic()
    time.sleep(seconds)
    (after,) = d.stats()["rows"]
    return (after["generated_tokens"] - before["generated_tokens"]) / (time.monotonic() - started)


def test_sigterm_lets_short_streams_finish_and_ends_long_ones(start):
    shutdown_timeout = 4
    d = start(shutdown_timeout)
    out: dict = {}
    threads = [stream_in_thread(d, 4000, out, "long")]
    d.wait_rows(1)
    # The short stream is sized to this machine's pace right now (issue 29: on a loaded
    # machine a fixed 400 tokens outlasted the 4 s): about a quarter of the timeout.
    short = max(20, min(400, int(_pace(d) * shutdown_timeout / 4)))
    threads.append(stream_in_thread(d, short, out, "short"))
    d.wait_rows(2)
    pid_before = d.proc.pid
    d.signal(signal.SIGTERM)
    ready = _wait_shutting_down(d)
    assert ready.status_code == 503 and ready.json()["reason"] == "shutting down"
    refused = httpx.post(
        f"{d.url}/v1/chat/completions",
        json={"model": "x", "messages": [{"role": "user", "content": "late"}], "max_tokens": 2},
        timeout=5,
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    for t in threads:
        t.join(60)
    assert d.proc.wait(60) == 0
    assert d.proc.pid == pid_before
    short = out["short"]
    assert (
        short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    )
    long = out["long"]
    assert long[-1] != "[DONE]"
    error = json.loads(long[-1])["error"]
    assert error["code"] == "shutting_down" and "shutdown_timeout" in error["message"]
    log = d.log()
    assert "SIGTERM received" in log and "ending the remaining requests" in log


def test_idle_sigterm_exits_zero_quickly(start):
    d = start(30)
    started = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert time.monotonic() - started < 15


def test_second_signal_exits_at_once(start):
    d = start(60)
    out: dict = {}
    t = stream_in_thread(d, 4000, out, "long")
    d.wait_rows(1)
    d.signal(signal.SIGTERM)
    _wait_shutting_down(d)  # the SIGTERM was handled
    time.sleep(0.5)
    assert d.proc.poll() is None  # still draining: the timeout is 60 s
    d.signal(signal.SIGINT)
    assert d.proc.wait(10) != 0
    t.join(30)
