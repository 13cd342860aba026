"""``/ready`` says why when an engine's start is past ``[server] engine_start_timeout``.

The model load is held (in process: a stand-in for a hung mount); past the
deadline ``/ready`` answers 503 with the reason and a chat request gets 503
``model_load_failed`` at once instead of waiting.
"""

from __future__ import annotations

import threading

import httpx

from mlxd.engine.chat.served_model import ServedModel
from tests.support.daemon import toml_config
from tests.support.engine import wait_for
from tests.support.inprocess import AppInProcess


def test_ready_says_why_and_requests_get_503(tmp_path, monkeypatch, tiny_models):
    release = threading.Event()
    load_first = ServedModel.load_first

    def stuck_load_first(self):
        release.wait(60)
        return load_first(self)

    monkeypatch.setattr(ServedModel, "load_first", stuck_load_first)
    config = toml_config(
        model={"path": str(tiny_models("llama")), "name": "tiny"},
        server={"engine_start_timeout": 0.5},
    )
    daemon = AppInProcess(tmp_path, config)
    daemon.start(wait_ready=False)
    try:

        def not_ready_why():
            r = httpx.get(f"{daemon.url}/ready", timeout=5)
            return r if "did not finish starting" in r.text else None

        ready = wait_for(not_ready_why, timeout=30, interval=0.1)
        assert ready.status_code == 503 and "engine_start_timeout" in ready.json()["reason"]
        r = httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed", r.text
    finally:
        release.set()
        daemon.stop()
