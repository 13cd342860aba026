"""What real agents and front-ends need from the daemon, over HTTP (issue 21).

One daemon serves a tiny llama twice: ``plain`` with its ChatML template (no
tool parser, like the demo model before it shipped a tools template) and
``tools`` with the Hermes template. Checked: tools sent with ``tool_choice``
auto to a model that cannot call tools are left out and said so (header, log
line, ``/v1/models``) on every API, while a forced call stays a 400; Claude
Code's ``role: "system"`` messages; Anthropic's wording of a context overflow;
``max_tokens`` above the limit clamped on ``/v1/messages``; ``HEAD /``; and
keep-alives while a long prompt is read, in each API's own form.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

LIMIT = 16  # [limits] max_tokens
CONTEXT = 2048  # [model] max_context of "plain"
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
# About 1,500 tokens of the tiny tokenizer: its prefill takes far longer than a keep-alive.
LONG = "The quick brown fox reads the whole file before it edits a line of it. " * 90


@pytest.fixture(scope="module")
def daemon(apps) -> Daemon:
    chatml = str(tiny_model_dir("llama"))
    hermes = str(tiny_model_dir("llama", template="hermes"))
    config = toml_config(
        server={"stream_keepalive": 0.01},
        models={
            "plain": {"path": chatml, "default": True, "max_context": CONTEXT},
            "tools": {"path": hermes},
        },
        limits={"max_tokens": LIMIT},
        sampling={"max_tokens": 4},
    )
    # Its own: the test reads its log.
    return apps.get(config, name="agent-rules")


def _post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{d.url}{path}", json=body, timeout=60)


BODIES = {
    "/v1/chat/completions": {
        "model": "plain",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [TOOL],
        "max_tokens": 2,
    },
    "/v1/responses": {
        "model": "plain",
        "input": "hi",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "max_output_tokens": 2,
    },
    "/v1/messages": {
        "model": "plain",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [ANTHROPIC_TOOL],
        "max_tokens": 2,
    },
}


@pytest.mark.parametrize("path", list(BODIES))
def test_tools_to_a_model_that_cannot_call_them_are_left_out(daemon: Daemon, path: str):
    """Open WebUI sends its built-in tools with every chat; agents send theirs."""
    r = _post(daemon, path, BODIES[path])
    assert r.status_code == 200, r.text
    assert r.headers["x-mlxd-tools-ignored"] == "1"
    # The same model with a tool parser takes them: no header.
    r = _post(daemon, path, {**BODIES[path], "model": "tools"})
    assert r.status_code == 200, r.text
    assert "x-mlxd-tools-ignored" not in r.headers
    assert "tools_ignored=1" in daemon.log()


@pytest.mark.parametrize(
    ("path", "forced"),
    [
        ("/v1/chat/completions", {"tool_choice": "required"}),
        ("/v1/responses", {"tool_choice": {"type": "function", "name": "get_weather"}}),
        ("/v1/messages", {"tool_choice": {"type": "any"}}),
    ],
)
def test_a_forced_call_to_a_model_that_cannot_call_tools_is_a_400(daemon, path, forced):
    r = _post(daemon, path, {**BODIES[path], **forced})
    assert r.status_code == 400, r.text
    assert "has no tool-call parser" in r.text


def test_models_say_whether_tools_are_left_out(daemon: Daemon):
    models = {m["id"]: m for m in httpx.get(f"{daemon.url}/v1/models").json()["data"]}
    assert models["plain"]["capabilities"]["tools_ignored"] is True
    assert models["tools"]["capabilities"]["tools_ignored"] is False


def test_head_root_answers_200(daemon: Daemon):
    """Claude Code probes ``HEAD /`` at every start."""
    r = httpx.head(f"{daemon.url}/")
    assert r.status_code == 200 and r.content == b""
    # GET / still goes to the dashboard.
    r = httpx.get(f"{daemon.url}/", follow_redirects=False)
    assert r.status_code == 302 and r.headers["location"] == "/dashboard"


def test_system_messages_inside_messages_are_served(daemon: Daemon):
    """Claude Code's mid-conversation system messages (its beta for non-Claude model ids)."""
    body = {
        "model": "plain",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": "Rules."},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "1000 tokens left"}]},
        ],
    }
    r = _post(daemon, "/v1/messages", body)
    assert r.status_code == 200, r.text
    counted = _post(
        daemon, "/v1/messages/count_tokens", {k: body[k] for k in ("model", "messages")}
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_context_overflow_in_anthropics_words(daemon: Daemon):
    """Claude Code compacts its conversation only on this wording."""
    body = {"model": "plain", "max_tokens": 2, "messages": [{"role": "user", "content": LONG * 3}]}
    r = _post(daemon, "/v1/messages", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(
        f" tokens > {CONTEXT - 1} maximum"
    ), message
    assert int(message.split(": ")[1].split()[0]) >= CONTEXT
    # The other APIs keep OpenAI's wording, and the Responses API names its own param.
    r = _post(daemon, "/v1/responses", {"model": "plain", "input": LONG * 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "maximum context length" in r.json()["error"]["message"]


def test_max_tokens_above_the_limit_is_clamped_on_messages(daemon: Daemon):
    body = {"model": "plain", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]}
    r = _post(daemon, "/v1/messages", body)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["usage"]["output_tokens"] <= LIMIT
    if reply["usage"]["output_tokens"] == LIMIT:
        assert reply["stop_reason"] == "max_tokens"
    assert r.headers["x-mlxd-max-tokens"] == f"{LIMIT}; requested=32000"
    # Chat completions clamp it too (issue 33: opencode asks for 32000).
    r = _post(
        daemon, "/v1/chat/completions", {**BODIES["/v1/chat/completions"], "max_tokens": 32000}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= LIMIT


def _events(d: Daemon, path: str, body: dict[str, Any]) -> list[str]:
    """The SSE events of one stream, in order: event names, or ``:`` for a comment."""
    out = []
    with httpx.stream("POST", f"{d.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(":"):
                out.append(":")
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                out.append(data.get("type") or data.get("object", "chunk"))
    return out


@pytest.mark.parametrize(
    ("path", "body", "first", "keepalive", "content"),
    [
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2},
            "message_start",
            "ping",
            "content_block_start",
        ),
        (
            "/v1/responses",
            {"input": LONG, "max_output_tokens": 2},
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2},
            "chat.completion.chunk",
            ":",
            None,
        ),
    ],
)
def test_streams_stay_alive_while_a_long_prompt_is_read(
    daemon, path, body, first, keepalive, content
):
    """The stream starts before the prefill; keep-alives follow until the first token."""
    # A prompt of its own, from its first token: nothing of it is in the prompt cache.
    fresh = json.loads(json.dumps(body).replace("The quick", f"{uuid.uuid4().hex} The quick", 1))
    events = _events(daemon, path, {"model": "tools", **fresh})
    assert events[0] == first, events
    before = events[: events.index(content)] if content else events
    assert before.count(keepalive) >= (2 if keepalive == "response.in_progress" else 1), events
