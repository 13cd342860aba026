"""The idle-time lane on a real daemon: a long batch runs, an interactive request barely notices.

The bar (issue 24): while a long batch runs, an interactive request's time to
first token stays within one decode step plus its own prefill of what it is
on the idle daemon. Measured in one run as a ratio: the same kind of request
on the idle daemon, then while batch lines fill every row they may take; the
decode step is the batch rows' pace under load (from ``/stats``).
Batch lines never hold more than ``max_rows`` rows (default: all but one).
"""

from __future__ import annotations

import io
import json
import statistics
import threading
import time
from typing import Any

import httpx
import pytest

from tests.support.daemon import toml_config

WIDTH = 4  # [batch] size; batch lines may take WIDTH - 1 rows
TRIALS = 5
# A loaded 2-core machine (five helpers' suites; load average 7-11): the ratio measured
# 1.35-3.4 there, where batch lines that keep every row measured 5+ (the request then
# waits for a batch line to end). The engine thread's busy steps slow the HTTP side's
# Python too: the cost of a busy engine, whatever keeps it busy.
MARGIN = 4.0


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        model={"path": str(tiny_models("llama")), "name": "tiny"},
        batch={"size": WIDTH},
        sampling={"max_tokens": 4096},
    )
    return apps.get(config, name="batches-idle")


def ask(url: str, trial: int, tag: str) -> float:
    """One streamed interactive request's time to first token."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"{tag} question {trial}: what is a river?"}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
    }
    stamps: list[float] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    assert stamps
    return stamps[0] - start


def long_batch(client: Any, lines: int = 400) -> str:
    """Many lines of a few hundred tokens each: rows stay short (joining a batch copies
    its rows' KV, a cost of the engine's that grows with their length), the batch long."""

    def line(i: int) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Tell a very long story, part {i}."}],
            "max_tokens": 300,
            "temperature": 0,
        }
        return {"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}

    data = b"".join(json.dumps(line(i)).encode() + b"\n" for i in range(lines))
    upload = client.files.create(file=("long.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def test_interactive_ttft_while_a_long_batch_runs(daemon):
    client = daemon.openai()
    ask(daemon.url, -1, "warm")  # the first request pays one-time costs
    idle = [ask(daemon.url, t, "idle") for t in range(TRIALS)]
    batch_id = long_batch(client)
    peak_rows = 0
    watching = threading.Event()

    def watch() -> None:
        nonlocal peak_rows
        while not watching.is_set():
            peak_rows = max(peak_rows, daemon.stats()["batches"]["running_lines"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        deadline = time.monotonic() + 60
        while daemon.stats()["batches"]["running_lines"] < WIDTH - 1:
            assert time.monotonic() < deadline, daemon.stats()["batches"]
            time.sleep(0.05)
        watcher.start()
        loaded = []
        rates: list[float] = []
        for t in range(TRIALS):
            rates += [r["tokens_per_s"] for r in daemon.stats()["rows"] if r["tokens_per_s"] > 0]
            loaded.append(ask(daemon.url, t, "busy"))
            # Still open, so this request ran beside it (running_lines may read 0 for a
            # tick: when rows end together, the runner hands out the next lines then).
            assert client.batches.retrieve(batch_id).status == "in_progress", "the batch ended"
            time.sleep(0.2)  # let batch lines take the freed rows again
    finally:
        watching.set()
        client.batches.cancel(batch_id)
    ttft_idle = statistics.median(idle)
    ttft_busy = statistics.median(loaded)
    # One decode step of the loaded batch: the batch rows' own pace (a stream's gaps
    # between chunks are no measure: the server may send several tokens at once).
    step_busy = 1 / statistics.median(rates)
    ratio = ttft_busy / (ttft_idle + step_busy)
    print(
        f"\nTTFT idle {ttft_idle * 1000:.1f} ms, while a batch runs {ttft_busy * 1000:.1f} ms; "
        f"decode step under load {step_busy * 1000:.1f} ms; "
        f"busy / (idle + step) = {ratio:.2f} (bar {MARGIN}); "
        f"idle {[round(t * 1000) for t in idle]} busy {[round(t * 1000) for t in loaded]}"
    )
    assert ratio <= MARGIN
    assert 1 <= peak_rows <= WIDTH - 1  # batch lines never take the last row
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch_id).status != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.1)
