"""Who goes first (issue 23), against a real daemon with batch size 1 and several keys:
priority classes, fair share across keys, preemption that resumes with the same text,
quotas (429 with rate-limit headers in each API's shape), model allow-lists, and
unknown keys refused on every API."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from mlxd.control import status_lines
from tests.support.daemon import Daemon, toml_config
from tests.support.stats_schema import check_schema, documented_fields

KEYS: dict[str, dict[str, Any]] = {
    "family": {"key": "sk-family", "priority": "high"},
    "indexer": {"key": "sk-indexer", "priority": "low"},
    "agent": {"key": "sk-agent"},
    "guest": {"key": "sk-guest", "models": ["no-such-model*"]},
    "metered": {"key": "sk-metered", "requests_per_minute": 2},
}


def config(llama: str, **scheduling: Any) -> str:
    return toml_config(
        model={"path": llama, "name": "tiny", "max_context": 1024},
        batch={"size": 1},
        sampling={"temperature": 0.0},
        server={"api_keys": ["sk-legacy"]},
        scheduling={"aging": 600.0, **scheduling},
        keys=KEYS,
    )


@pytest.fixture(scope="module")
def llama(tiny_models) -> str:
    return str(tiny_models("llama"))


@pytest.fixture(scope="module")
def daemon(apps, llama):
    return apps.get(config(llama), name="priority")


def complete(
    daemon: Daemon, key: str, max_tokens: int, prompt: str = "the cat sat on", **kw: Any
) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **kw}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{daemon.url}/v1/completions", json=body, headers=headers, timeout=120)


class Finishes:
    """Requests sent from threads; the order in which they end."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.responses: dict[str, httpx.Response] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def send(self, name: str, call: Callable[[], httpx.Response]) -> None:
        def run() -> None:
            r = call()
            with self._lock:
                self.order.append(name)
                self.responses[name] = r

        t = threading.Thread(target=run)
        t.start()
        self._threads.append(t)

    def join(self) -> None:
        for t in self._threads:
            t.join(timeout=300)
        for name, r in self.responses.items():
            assert r.status_code == 200, (name, r.text)


def wait_for(daemon: Daemon, ready: Callable[[dict[str, Any]], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready(daemon.stats()):
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out; /stats: {daemon.stats()}")


def by_name(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k["name"]: k for k in stats["keys"]}


def test_a_high_priority_request_ends_before_the_second_of_four_queued_low_ones(daemon):
    runs = Finishes()
    for i in range(4):
        # low0 is long enough to still run when the rest (and the high one) are queued.
        runs.send(f"low{i}", lambda i=i: complete(daemon, "sk-indexer", 1000 if i == 0 else 100))
        # One at a time, so that their arrival order is known: low0 runs, the rest wait.
        wait_for(daemon, lambda s, i=i: len(s["rows"]) + len(s["pending"]) >= i + 1)
    runs.send("high", lambda: complete(daemon, "sk-family", 20))
    wait_for(daemon, lambda s: any(p["key"] == "family" for p in s["pending"] + s["rows"]))
    runs.join()
    assert runs.order.index("high") < runs.order.index("low1"), runs.order
    assert runs.order.index("high") > runs.order.index("low0"), runs.order  # no preemption


def test_one_keys_flood_holds_another_keys_request_behind_at_most_two(daemon):
    runs = Finishes()
    for i in range(6):
        runs.send(f"flood{i}", lambda i=i: complete(daemon, "sk-agent", 600 if i == 0 else 100))
    wait_for(daemon, lambda s: len(s["rows"]) + len(s["pending"]) >= 6)
    runs.send("single", lambda: complete(daemon, "sk-legacy", 20))
    runs.join()
    before = runs.order[: runs.order.index("single")]
    assert len(before) <= 2, runs.order


def ran_at(daemon: Daemon, key: str, send: Callable[[], httpx.Response]) -> str:
    """The priority class the request ``send`` makes ran at, read from its log line."""
    seen = {c: daemon.log().count(f"key={key} priority={c} ") for c in ("high", "normal", "low")}
    r = send()
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10  # the line is written once the answer is sent
    while time.monotonic() < deadline:
        log = daemon.log()
        for c, n in seen.items():
            if log.count(f"key={key} priority={c} ") > n:
                return c
        time.sleep(0.05)
    raise AssertionError("no request log line")


def test_a_request_may_lower_its_priority_never_raise_it(daemon):
    assert ran_at(daemon, "indexer", lambda: complete(daemon, "sk-indexer", 2)) == "low"
    raise_it = lambda: complete(daemon, "sk-indexer", 2, priority="high")  # noqa: E731
    assert ran_at(daemon, "indexer", raise_it) == "low"
    assert ran_at(daemon, "family", lambda: complete(daemon, "sk-family", 2)) == "high"
    flex = lambda: complete(daemon, "sk-family", 2, service_tier="flex")  # noqa: E731
    assert ran_at(daemon, "family", flex) == "low"
    vllm = lambda: complete(daemon, "sk-family", 2, priority=3)  # noqa: E731 - vLLM's int
    assert ran_at(daemon, "family", vllm) == "low"
    normal = lambda: complete(daemon, "sk-family", 2, priority="normal")  # noqa: E731
    assert ran_at(daemon, "family", normal) == "normal"
    bad = complete(daemon, "sk-family", 2, priority="urgent")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_preemption_pauses_a_low_row_and_it_resumes_with_the_same_text(daemon, llama):
    prompt = "once upon a time"
    alone = complete(daemon, "sk-indexer", 900, prompt=prompt)
    assert alone.status_code == 200, alone.text
    assert alone.json()["usage"]["completion_tokens"] == 900
    daemon.write_config(config(llama, preempt=True))
    assert daemon.reload().json()["outcome"] == "applied"
    try:
        before = daemon.stats()["counters"]["preemptions"]
        runs = Finishes()
        runs.send("low", lambda: complete(daemon, "sk-indexer", 900, prompt=prompt))
        wait_for(daemon, lambda s: any(r["generated_tokens"] >= 30 for r in s["rows"]))
        runs.send("high", lambda: complete(daemon, "sk-family", 30, prompt="hello"))
        runs.join()
    finally:
        daemon.write_config(config(llama))
        assert daemon.reload().json()["outcome"] == "applied"
    assert runs.order == ["high", "low"]
    low = runs.responses["low"].json()
    assert low["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert low["usage"]["completion_tokens"] == 900
    assert low["usage"]["prompt_tokens"] == alone.json()["usage"]["prompt_tokens"]
    stats = daemon.stats()
    assert stats["counters"]["preemptions"] == before + 1
    event = stats["preemptions"][0]
    assert (event["key"], event["priority"], event["by_priority"]) == ("indexer", "low", "high")
    assert event["generated_tokens"] >= 30
    assert by_name(stats)["indexer"]["preemptions"] >= 1
    fields, seen = documented_fields(), set()
    check_schema(stats, fields, seen)
    assert {f for f in fields if f.startswith(("keys[].", "preemptions[]."))} <= seen


def chat(daemon: Daemon, key: str, **body: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me"}], **body}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{daemon.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_a_preempted_constrained_row_resumes_its_grammar_logprobs_and_stops(daemon, llama):
    # A JSON grammar, logprobs and a stop string: all the row's state must carry over.
    schema = {
        "type": "object",
        "properties": {"story": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["story", "n"],
    }
    body = {
        "max_tokens": 600,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ["zzzq"],
    }
    alone = chat(daemon, "sk-indexer", **body)
    assert alone.status_code == 200, alone.text
    # Long enough to be caught (it ends by itself: the integer's digits are bounded).
    assert alone.json()["usage"]["completion_tokens"] >= 300
    daemon.write_config(config(llama, preempt=True))
    assert daemon.reload().json()["outcome"] == "applied"
    try:
        before = daemon.stats()["counters"]["preemptions"]
        runs = Finishes()
        runs.send("low", lambda: chat(daemon, "sk-indexer", **body))
        wait_for(daemon, lambda s: any(r["generated_tokens"] >= 10 for r in s["rows"]))
        runs.send("high", lambda: complete(daemon, "sk-family", 10, prompt="hi"))
        runs.join()
        assert daemon.stats()["counters"]["preemptions"] == before + 1
    finally:
        daemon.write_config(config(llama))
        assert daemon.reload().json()["outcome"] == "applied"
    got, want = runs.responses["low"].json()["choices"][0], alone.json()["choices"][0]
    assert runs.order == ["high", "low"]
    assert got["message"]["content"] == want["message"]["content"]
    assert got["logprobs"] == want["logprobs"]
    assert got["finish_reason"] == want["finish_reason"]


def test_keys_reload_live_and_their_counts_survive_a_reload(daemon, llama):
    assert complete(daemon, "sk-newcomer", 2).status_code == 401
    counted = by_name(daemon.stats())["agent"]["requests_total"]
    keys = {**KEYS, "newcomer": {"key": "sk-newcomer", "priority": "low"}}
    text = config(llama).replace(toml_config(keys=KEYS), toml_config(keys=keys))
    assert "newcomer" in text
    daemon.write_config(text)
    try:
        assert daemon.reload().json()["outcome"] == "applied"
        assert complete(daemon, "sk-newcomer", 2).status_code == 200
        assert by_name(daemon.stats())["agent"]["requests_total"] == counted
    finally:
        daemon.write_config(config(llama))
        assert daemon.reload().json()["outcome"] == "applied"
    assert complete(daemon, "sk-newcomer", 2).status_code == 401


def test_a_key_over_its_request_rate_gets_429_with_rate_limit_headers(daemon):
    # sk-metered: 2 requests a minute. The rest of this module never uses it.
    ok = complete(daemon, "sk-metered", 2)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    client = anthropic.Anthropic(base_url=daemon.url, api_key="sk-metered", max_retries=0)
    client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    r = complete(daemon, "sk-metered", 2)
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    m = caught.value.response
    assert m.json()["type"] == "error" and m.json()["error"]["type"] == "rate_limit_error"
    assert m.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert m.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert m.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert int(m.headers["retry-after"]) >= 1
    usage = by_name(daemon.stats())["metered"]
    assert usage["requests_last_minute"] == 2 and usage["refused"] == 2


def test_a_keys_models_list_is_enforced(daemon):
    r = complete(daemon, "sk-guest", 2)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "model_not_allowed"
    client = anthropic.Anthropic(base_url=daemon.url, api_key="sk-guest", max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError):
        client.messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert complete(daemon, "sk-agent", 2).status_code == 200
    # /v1/models lists what the key may use.
    listed = httpx.get(f"{daemon.url}/v1/models", headers={"x-api-key": "sk-guest"}).json()
    assert listed["data"] == []
    one = httpx.get(f"{daemon.url}/v1/models/tiny", headers={"x-api-key": "sk-guest"})
    assert one.status_code == 404
    listed = httpx.get(f"{daemon.url}/v1/models", headers={"x-api-key": "sk-agent"}).json()
    assert [m["id"] for m in listed["data"]] == ["tiny"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": []}),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
        ("POST", "/v1/responses", {"model": "tiny", "input": "x"}),
        ("POST", "/v1/embeddings", {"model": "tiny", "input": "x"}),
        ("GET", "/v1/models", None),
    ],
)
def test_unknown_keys_get_401_on_every_openai_route(daemon, method, path, body):
    for headers in ({"Authorization": "Bearer sk-nobody"}, {"x-api-key": "sk-nobody"}, {}):
        r = httpx.request(method, daemon.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_unknown_keys_get_401_on_messages_in_anthropics_shape(daemon):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(
            base_url=daemon.url, api_key="sk-nobody", max_retries=0
        ).messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    body = caught.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="sk-nobody", max_retries=0).models.list()


def test_keys_show_by_name_in_stats_status_and_metrics_never_their_secret(daemon):
    assert complete(daemon, "sk-agent", 2).status_code == 200
    stats = daemon.stats()
    keys = by_name(stats)
    assert set(keys) >= {"family", "indexer", "agent", "guest", "metered", "api_keys[0]"}
    assert keys["family"]["priority"] == "high"
    assert keys["agent"]["tokens_last_minute"] > 0
    text = httpx.get(f"{daemon.url}/stats").text + httpx.get(f"{daemon.url}/metrics").text
    assert "sk-agent" not in text and "sk-family" not in text
    metrics = httpx.get(f"{daemon.url}/metrics").text
    assert 'mlxd_key_requests_total{key="agent"' in metrics
    assert "mlxd_preemptions_total" in metrics
    lines, _ = status_lines(daemon.url, stats)
    assert any(line.lstrip().startswith("key agent") for line in lines), lines


def test_the_dashboard_shows_who_and_the_preemption(daemon):
    who = httpx.get(f"{daemon.url}/dashboard/who").text
    for name in ("family", "indexer", "agent", "metered", "api_keys[0]"):
        assert f'data-key="{name}"' in who
    assert 'class="badge priority-high" data-field="priority">high' in who
    assert "preempted</span>" in who  # the daemon-wide count, after the preemption test
    events = httpx.get(f"{daemon.url}/dashboard/event-log").text
    assert 'data-kind="preemption"' in events and "low row yielded to a high request" in events
    page = httpx.get(f"{daemon.url}/dashboard").text
    assert 'id="who"' in page and "sk-family" not in page and "sk-indexer" not in page


@pytest.mark.browser
def test_the_who_panel_in_a_browser_at_phone_width(daemon, pages):
    phone = pages(viewport={"width": 390, "height": 844}, device_scale_factor=2)
    problems: list[str] = []
    phone.on("pageerror", lambda e: problems.append(str(e)))
    phone.goto(f"{daemon.url}/dashboard")
    row = phone.locator('#who tbody tr[data-key="family"]')
    row.wait_for(timeout=20_000)
    assert row.evaluate("e => getComputedStyle(e).display") == "grid"  # a card
    assert row.locator("[data-field=priority]").inner_text() == "high"
    # The panel polls itself: it is replaced in place, and still there afterwards.
    phone.wait_for_timeout(2500)
    assert phone.locator("#who tbody tr").count() == len(KEYS) + 1  # + api_keys[0]
    overflow = phone.evaluate(
        "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px on a phone"
    assert not problems, problems
