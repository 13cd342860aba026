"""Hardening around the daemon's life: abandoned requests and SIGTERM, a model
path typo in a reload, a stalled body off loopback. (Binding off loopback without
an admin token is loud: tests/dashboard/test_dashboard.py, on its two daemons.)"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.support.daemon import Daemon, toml_config


def _tiny_config(tiny_models, **sections) -> str:
    return toml_config(
        model={"path": str(tiny_models("llama"))},
        batch={"size": 4},
        sampling={"temperature": 0.0},
        **sections,
    )


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _abandon(d: Daemon, model: str, out: list, *, stream: bool) -> None:
    """A client that gives up after 0.5 s, mid-generation (noted in ``out``)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 4000,
        "stream": stream,
    }
    started = time.monotonic()
    try:
        with httpx.Client(base_url=d.url, timeout=0.5) as client:
            if stream:
                # Tokens keep coming, so the read timeout never fires: leave after 0.5 s.
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if time.monotonic() - started > 0.5:
                            out.append(stream)
                            return
            else:
                client.post("/v1/chat/completions", json=body)
    except httpx.TimeoutException:
        out.append(stream)


def test_abandoned_requests_end_their_handlers_and_sigterm_is_prompt(tmp_path, tiny_models):
    d = Daemon(tmp_path, _tiny_config(tiny_models, server={"shutdown_timeout": 1.0})).start()
    try:
        model = d.model_id()
        gave_up: list[bool] = []
        threads = [
            threading.Thread(
                target=_abandon, args=(d, model, gave_up), kwargs={"stream": i % 2 == 0}
            )
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        _wait(lambda: not d.stats()["busy"])
        # (A random-weight row may end early; most outlast their client.)
        assert len(gave_up) >= 4 and False in gave_up
        # A client that gives up while its request is still being tokenized is
        # cancelled in intake (counted as a rejection); on a loaded machine that
        # is where half of them were once, with only the batch counted.
        counters = d.stats()["counters"]
        cancelled = counters["requests"]["batch"]["cancelled"]
        assert cancelled + counters["rejected"].get("cancelled", 0) == len(gave_up), counters
        started = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        took = time.monotonic() - started
    finally:
        d.stop()
    log = d.log()
    # uvicorn reports handler tasks it had to cancel; there must be none left.
    assert "graceful shutdown exceeded" not in log, log[-2000:]
    assert "Cancel " not in log
    # The shutdown_timeout and the exit (1.5 s under load), with room for a stall
    # of the whole machine (1.6 s ones were measured on the 2-core VM under load);
    # handlers left waiting would show in the log lines above.
    assert took < 1.0 + 5.0, took


def test_model_path_typo_is_refused_before_anything_drains(tmp_path, tiny_models):
    good = _tiny_config(tiny_models)
    d = Daemon(tmp_path, good).start()
    try:
        model = d.model_id()
        out: dict = {}

        def stream():
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "long"}],
                # Seconds of decoding: the two refused reloads below take about a tenth of
                # a second (each must take under 4 s), and the stream must outlast them.
                "max_tokens": 1000,
                "stream": True,
            }
            with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=body, timeout=120) as r:
                out["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        t = threading.Thread(target=stream)
        t.start()
        _wait(lambda: d.stats()["batch"]["active_rows"] == 1)
        for bad in ("/no/such/model", str(tmp_path)):  # missing; a directory with no model
            d.write_config(good.replace(str(tiny_models("llama")), bad))
            started = time.monotonic()
            r = d.reload()
            assert r.status_code == 400, r.text
            assert time.monotonic() - started < 4  # 0.1 s here; whole-VM stalls of 1.6 s seen
            body = r.json()
            assert body["error"]["code"] == "invalid_config"
            assert "[model] path" in body["error"]["message"]
            stats = d.stats()
            assert stats["batch"]["active_rows"] == 1  # the stream was never drained
            assert not stats["drains"], stats["drains"]
        d.write_config(good)
        t.join(120)
        assert out["lines"][-1] == "data: [DONE]"
        assert stats["model"]["name"] == model
    finally:
        d.stop()


def test_check_config_checks_the_model_directory(tmp_path):
    config = tmp_path / "mlxd.toml"
    config.write_text(toml_config(model={"path": str(tmp_path / "missing")}))
    cmd = [sys.executable, "-m", "mlxd", "check-config", str(config)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "[model] path" in r.stderr and "is not a directory" in r.stderr
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no *.safetensors weights" in r.stderr


def test_a_model_that_fails_to_load_keeps_its_path_from_clients(tmp_path, tiny_models):
    # A model directory that passes the checks at start but cannot load.
    private = tmp_path / "private-models" / "broken"
    private.mkdir(parents=True)
    (private / "config.json").write_text((tiny_models("llama") / "config.json").read_text())
    (private / "model.safetensors").write_bytes(b"\x00" * 100)
    d = Daemon(tmp_path, toml_config(model={"path": str(private), "name": "broken"}))
    d.start(wait_ready=False)
    try:
        _wait(lambda: _answers(d, "/health"), timeout=120)
        with d.client() as http:
            _wait(lambda: http.get("/ready").json().get("reason", "").startswith("mlx_lm"), 120)
            ready = http.get("/ready")
            chat = http.post(
                "/v1/chat/completions",
                json={"model": "broken", "messages": [{"role": "user", "content": "hi"}]},
            )
            models = http.get("/v1/models")
            stats = http.get("/stats")
        assert ready.status_code == 503 and chat.status_code == 503
        assert chat.json()["error"]["code"] == "model_load_failed"
        # Clients read why, without where: no part of the server's path.
        for answer in (ready, chat, models):
            assert "private-models" not in answer.text and str(tmp_path) not in answer.text
            assert "<path>" in answer.text, answer.text
        # The operator's views keep it: /stats and the log.
        assert str(private) in stats.text
        assert str(private) in d.log()
    finally:
        d.stop()


def _answers(d: Daemon, path: str) -> bool:
    try:
        return httpx.get(f"{d.url}{path}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_off_loopback_a_stalled_body_is_cut_off_before_authentication(tmp_path, tiny_models):
    # Bound off loopback with an admin token, a client without it that stops
    # sending its form once held the connection for ever (the CSRF check and
    # the form parser waited for the body before any guard ran).
    config = _tiny_config(
        tiny_models,
        server={"host": "0.0.0.0", "admin_token": "t0ken", "api_keys": ["k"]},
        limits={"body_timeout": 1.0},
    )
    d = Daemon(tmp_path, config).start()
    try:
        for path in ("/dashboard/models/load", "/dashboard/config/apply", "/v1/chat/completions"):
            kind = (
                "application/json"
                if path.startswith("/v1")
                else "application/x-www-form-urlencoded"
            )
            head = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{d.port}\r\n"
                f"Content-Type: {kind}\r\nContent-Length: 500\r\n\r\nmodel="
            ).encode()
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", d.port), timeout=10) as sock:
                sock.sendall(head)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), (path, answer[:200])
            assert time.monotonic() - started < 5
        # A complete, unauthenticated write is still refused as before.
        r = httpx.post(f"{d.url}/dashboard/models/load", data={"model": "x"}, timeout=10)
        assert r.status_code in (401, 403)
    finally:
        d.stop()
