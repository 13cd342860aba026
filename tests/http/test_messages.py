"""The official ``anthropic`` client against ``/v1/messages`` on the real daemon and the
real demo model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import pytest

from tests.support.daemons import DEMO_SDK

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who loves books."}]


@pytest.fixture(scope="module")
def daemon(daemons):
    # The demo daemon the SDK modules share (gpt-5* and claude-* aliases, max_stored 3).
    return daemons.get(DEMO_SDK)


@pytest.fixture(scope="module")
def claude(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(daemon):
    return daemon.model_id()


def test_text_answer_with_usage(claude, model):
    raw = claude.messages.with_raw_response.create(model=model, max_tokens=30, messages=FRANCE)
    assert raw.headers["x-mlxd-lane"] == "batch"
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    assert msg.id.startswith("msg_")
    (block,) = msg.content
    assert block.type == "text" and "Paris" in block.text, block.text
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    u = msg.usage
    assert 0 < u.output_tokens <= 30
    assert u.input_tokens + u.cache_read_input_tokens > 10


def test_system_prompt_as_string_and_blocks(claude, model):
    text = "You answer in one short sentence."
    a = claude.messages.create(model=model, max_tokens=30, system=text, messages=FRANCE)
    b = claude.messages.create(
        model=model,
        max_tokens=30,
        system=[{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": FRANCE[0]["content"]}]},
        ],
    )
    assert a.content[0].text == b.content[0].text
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == (
        b.usage.input_tokens + b.usage.cache_read_input_tokens
    )


def test_max_tokens_and_stop_sequences(claude, model):
    cut = claude.messages.create(model=model, max_tokens=2, messages=FRANCE)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    whole = claude.messages.create(model=model, max_tokens=30, messages=FRANCE)
    word = whole.content[0].text.split()[2]  # "The capital of ..."
    stopped = claude.messages.create(
        model=model, max_tokens=30, messages=FRANCE, stop_sequences=[word]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text
    assert whole.content[0].text.startswith(stopped.content[0].text)


def test_stream_event_sequence(daemon, model):
    body = {"model": model, "max_tokens": 30, "messages": FRANCE, "stream": True}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
    with httpx.stream("POST", f"{daemon.url}/v1/messages", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = datas[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert datas[1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
    assert "Paris" in text
    final = datas[-2]
    assert final["delta"]["stop_reason"] == "end_turn" and final["usage"]["output_tokens"] > 0


def test_sdk_stream_equals_whole_message(claude, model):
    whole = claude.messages.create(model=model, max_tokens=30, messages=FRANCE)
    with claude.messages.stream(model=model, max_tokens=30, messages=FRANCE) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_equals_the_prompt_the_engine_runs(daemon, claude, model):
    system = "You are terse."
    counted = claude.messages.count_tokens(model=model, system=system, messages=FRANCE)
    msg = claude.messages.create(model=model, max_tokens=5, system=system, messages=FRANCE)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    chat = daemon.openai().chat.completions.create(
        model=model,
        max_tokens=1,
        messages=[{"role": "system", "content": system}, *FRANCE],
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_claude_model_ids_are_aliases(claude, model):
    for tier in ("claude-sonnet-4-5-20250929", "claude-haiku-4-5", "claude-opus-4-1"):
        msg = claude.messages.create(model=tier, max_tokens=3, messages=FRANCE)
        assert msg.model == model
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="gpt-4o", max_tokens=3, messages=FRANCE)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_errors_are_typed_sdk_exceptions(claude, model):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=model, max_tokens=0, messages=FRANCE)
    assert err.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": err.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=5, messages=[])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=model, max_tokens=5, messages=[{"role": "system", "content": "x"}]
        )
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=model,
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="other", messages=FRANCE)


def test_bad_bodies_get_the_anthropic_envelope(daemon, model):
    cases = [
        {"model": model, "messages": FRANCE},  # max_tokens is required
        {"model": model, "max_tokens": 5},
        {"model": model, "max_tokens": 5, "messages": FRANCE, "frobnicate": 1},
        {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": 5}]},
        {
            "model": model,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "video"}]}],
        },
        {"model": model, "max_tokens": 5, "messages": FRANCE, "temperature": 1.5},
        {"model": model, "max_tokens": 5, "messages": FRANCE, "top_k": -1},
        {
            "model": model,
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "prefill"},
            ],
        },
        {"model": model, "max_tokens": 5, "messages": FRANCE, "thinking": {"type": "sometimes"}},
    ]
    with daemon.client() as http:
        for body in cases:
            r = http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
            assert r.status_code == 400, (body, r.text)
            err = r.json()
            assert set(err) == {"type", "error"} and err["type"] == "error"
            assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
        r = http.post(
            "/v1/messages", content=b"[1, 2", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = http.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = http.post("/v1/messages/batches", json={})
        assert r.status_code in (404, 405) and r.json()["type"] == "error"
        # The chat routes keep the OpenAI shape.
        assert "type" not in http.get("/v1/nowhere").json()
    msg = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0).messages.create(
        model=model, max_tokens=30, messages=FRANCE
    )
    assert "Paris" in msg.content[0].text


def test_stats_show_which_api_a_row_came_from(daemon, claude, model):
    # 32 steps (a second or more on the demo model) are ample to see the row in /stats.
    greedy = claude.messages.create(model=model, max_tokens=32, messages=STORY)
    assert greedy.stop_reason == "max_tokens"  # so the streamed twin runs 32 steps
    with claude.messages.stream(model=model, max_tokens=32, messages=STORY) as stream:
        next(iter(stream))  # message_start: the engine has accepted the row
        deadline = time.monotonic() + 30
        seen, html = [], ""
        while time.monotonic() < deadline and not seen:
            stats = httpx.get(f"{daemon.url}/stats", timeout=10).json()
            seen = [r["api"] for r in stats["rows"] + stats["pending"]]
            html = httpx.get(f"{daemon.url}/dashboard/active-rows", timeout=10).text
        stream.close()
    assert seen == ["messages"]
    assert 'data-field="api">messages<' in html


def test_a_client_that_leaves_cancels_its_row(daemon, claude, model):
    def cancelled() -> int:
        return httpx.get(f"{daemon.url}/stats", timeout=10).json()["counters"]["requests"]["batch"][
            "cancelled"
        ]

    def idle() -> bool:
        stats = httpx.get(f"{daemon.url}/stats", timeout=10).json()
        return not stats["rows"] and not stats["pending"]

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not idle():  # an earlier test's row may be leaving
        time.sleep(0.1)
    before = cancelled()
    apis = httpx.get(f"{daemon.url}/stats", timeout=10).json()["counters"]["by_api"]
    with claude.messages.stream(model=model, max_tokens=200, messages=STORY) as stream:
        next(iter(stream))
    # Leaving the block closed the connection: the row leaves at the next token.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and cancelled() == before:
        time.sleep(0.1)
    assert cancelled() == before + 1
    stats = httpx.get(f"{daemon.url}/stats", timeout=10).json()
    assert stats["rows"] == []
    assert stats["counters"]["by_api"]["messages"] == apis.get("messages", 0) + 1
    metrics = httpx.get(f"{daemon.url}/metrics", timeout=10).text
    assert re.search(
        r'^mlxd_api_requests_total\{api="messages",model="[^"]+"\} [1-9]', metrics, re.M
    )


def test_the_demo_model_calls_tools_out_of_the_box(daemon, claude, model):
    """With no config, the demo model renders tools with mlxd's shipped hermes-tools
    template and parses its calls (json_tools): agents can be tried with no download."""
    caps = httpx.get(f"{daemon.url}/v1/models/{model}").json()["capabilities"]
    assert caps["tools"] is True and caps["tool_format"] == "json_tools"
    weather = {
        "name": "get_weather",
        "description": "Current weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    }
    msg = claude.messages.create(
        model=model,
        max_tokens=60,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and [c.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].input["city"], str)
    # And the round trip: the tool's result goes back; the model answers (tools still sent).
    reply = claude.messages.create(
        model=model,
        max_tokens=20,
        tools=[weather],
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [c.model_dump() for c in calls]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny"}
                ],
            },
        ],
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
