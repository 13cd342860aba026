"""A huge prompt must not stall the streams already running (demo model).

Tokenizing a long prompt takes about a second on this kind of machine. It
happens on the engine's intake thread, so a running stream keeps its pace:
while another request is tokenized, its median inter-token gap stays within
a small factor of its own median just before, and no gap comes near the time
the tokenizing took. Prompts that certainly exceed the context are refused from
their length alone, before any tokenizing.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import threading
import time

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(daemons):
    # One BLAS thread leaves the second core of a 2-core CI machine to the
    # intake thread, so the test sees stalls, not CPU contention.
    config = toml_config(batch={"size": 4}, sampling={"temperature": 0.0}, runtime={"threads": 1})
    return daemons.get(config)


def _stream(d: Daemon, model: str, times: list[float], stop: threading.Event) -> None:
    """Stream a long story, noting each token's arrival; the client leaves once ``stop`` is set."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": 160,
        "stream": True,
        # Keep the story going: the end-of-turn token is forbidden.
        "logit_bias": {"2": -100},
    }
    with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.monotonic())
            if stop.is_set():
                break


def test_a_huge_prompt_does_not_stall_running_streams(daemon):
    model = daemon.model_id()
    info = httpx.get(f"{daemon.url}/v1/models", timeout=10).json()["data"][0]
    times: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_stream, args=(daemon, model, times, stop))
    t.start()
    deadline = time.monotonic() + 120
    while len(times) < 40:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    # Under the cheap length bound, so it is really tokenized (digits are one
    # token each: seconds of work), then refused: far more tokens than the
    # context holds.
    text = "".join(random.Random(0).choices("0123456789", k=600_000))
    sent_at = time.monotonic()
    r = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": text}]},
        timeout=120,
    )
    answered_at = time.monotonic()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" not in r.json()["error"]["message"]  # it was tokenized
    # A multi-megabyte prompt is refused from its length, before tokenizing.
    huge = "x" * 3_900_000
    started = time.monotonic()
    r = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": huge}]},
        timeout=120,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]
    refused_in = time.monotonic() - started
    # The gaps that matter end with the first token after the tokenizing: then the
    # client may leave (the rest of the 160 tokens would measure nothing).
    deadline = time.monotonic() + 120
    while t.is_alive() and times[-1] <= answered_at:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stop.set()
    t.join(300)
    assert answered_at - sent_at > 0.2, "the prompt was not really tokenized"
    gaps = list(itertools.pairwise(times))
    before = [b - a for a, b in gaps if b < sent_at]
    # Every gap that overlaps the time the big prompt was being handled.
    during = [b - a for a, b in gaps if b >= sent_at and a <= answered_at]
    step = statistics.median(before[5:])
    assert during, "no token arrived while the prompt was tokenized"
    print(
        f"step {step * 1000:.0f} ms; while a {answered_at - sent_at:.1f} s prompt was "
        f"tokenized, median gap {statistics.median(during) * 1000:.0f} ms, "
        f"worst {max(during) * 1000:.0f} ms over {len(during)} tokens"
    )
    # Measured against this same stream just before (issues 22 and 29: a loaded 2-core
    # machine stretches every gap, and tokenizing takes one core from the engine): its
    # usual pace holds within a factor of three, and no single gap comes near the
    # tokenizing time. An engine blocked for the tokenizing (or most of it) would show
    # one gap as long as the tokenizing, and a median gap of that size too.
    tokenizing = answered_at - sent_at
    pace = statistics.median(during)
    assert pace <= 3 * step, (step, pace, sorted(during)[-5:])
    assert max(during) < tokenizing / 2, (tokenizing, sorted(during)[-5:])
    # A stall would have been visible: tokenizing took several steps' time.
    assert tokenizing > 3 * step
    # The 3.9 MB prompt (6.5 times the characters) was refused faster than the
    # 600,000-character one was tokenized: it never was.
    assert refused_in < tokenizing, (refused_in, tokenizing)
    assert info["max_token_chars"] * info["context_length"] < len(huge)
