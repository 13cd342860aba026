"""Preemption in the batch lane (issue 23): with every row taken, a high-priority request
makes the most recently started low row yield; it resumes from its kept cache and its
stream (text and logprobs) is exactly what it gives alone."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config

KEYS = {"me": {"key": "sk-me", "priority": "high"}, "bulk": {"key": "sk-bulk", "priority": "low"}}


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        model={"path": str(tiny_models("llama")), "name": "tiny", "max_context": 1024},
        batch={"size": 2},
        sampling={"temperature": 0.0},
        scheduling={"preempt": True},
        keys=KEYS,
    )
    return apps.get(config, name="preemption-batch")


def stream(daemon: Daemon, key: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed completion with logprobs: its text, token logprobs and finish, joined."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "logprobs": 1,
    }
    text, tokens, finish = [], [], None
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{daemon.url}/v1/completions", json=body, headers=headers, timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            if choice.get("logprobs"):
                tokens += choice["logprobs"]["tokens"]
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "tokens": tokens, "finish": finish, "ended": time.monotonic()}


def test_a_high_request_preempts_the_newest_low_row_which_resumes_with_the_same_stream(daemon):
    prompts = {"a": "once upon a time", "b": "the cat sat on the mat and"}
    alone = {name: stream(daemon, "sk-bulk", p, 800) for name, p in prompts.items()}
    assert all(len(a["tokens"]) == 800 for a in alone.values())
    out: dict[str, dict[str, Any]] = {}

    def run(name: str, key: str, prompt: str, n: int) -> None:
        out[name] = stream(daemon, key, prompt, n)

    threads = [threading.Thread(target=run, args=("a", "sk-bulk", prompts["a"], 800))]
    threads[0].start()
    daemon.wait_rows(1)
    threads.append(threading.Thread(target=run, args=("b", "sk-bulk", prompts["b"], 800)))
    threads[1].start()
    daemon.wait_rows(2, tokens=20)
    before = daemon.stats()["counters"]["preemptions"]
    threads.append(threading.Thread(target=run, args=("high", "sk-me", "hello", 20)))
    threads[2].start()
    for t in threads:
        t.join(timeout=300)
    assert out["high"]["ended"] < min(out["a"]["ended"], out["b"]["ended"])
    for name in prompts:
        assert out[name]["text"] == alone[name]["text"], name
        assert out[name]["tokens"] == alone[name]["tokens"], name
        assert out[name]["finish"] == "length"
    stats = daemon.stats()
    assert stats["counters"]["preemptions"] == before + 1
    assert stats["counters"]["resumed"] >= 1
    event = stats["preemptions"][0]
    assert event["lane"] == "batch" and event["key"] == "bulk"


def test_a_low_serial_waiter_does_not_hold_a_high_batch_request_behind_its_drain(daemon):
    # Two low rows run; a low seeded request (serial lane) waits for them, which drains
    # the batch; a high request arriving then is admitted (preempting a low row), not
    # held behind the drain and the seeded request.
    done: dict[str, float] = {}

    def run(name: str, key: str, n: int, **kw: Any) -> None:
        body = {"model": "tiny", "prompt": f"story {name}", "max_tokens": n, **kw}
        r = httpx.post(
            f"{daemon.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()

    threads = [threading.Thread(target=run, args=(f"bulk{i}", "sk-bulk", 400)) for i in range(2)]
    for t in threads:
        t.start()
    daemon.wait_rows(2, tokens=5)
    threads.append(threading.Thread(target=run, args=("seeded", "sk-bulk", 50), kwargs={"seed": 1}))
    threads[-1].start()
    deadline = time.monotonic() + 30
    while not daemon.stats()["batch"]["admission_paused"]:
        assert time.monotonic() < deadline, daemon.stats()
        time.sleep(0.02)
    threads.append(threading.Thread(target=run, args=("high", "sk-me", 10)))
    threads[-1].start()
    for t in threads:
        t.join(timeout=300)
    assert done["high"] < min(done["seeded"], done["bulk0"], done["bulk1"]), done
