"""Enforced calls in the tool-call formats, through the real app on a tiny random-weight llama.

One app serves the same tiny model once per format named in FORMATS (every
format is walked without a model in tests/engine/test_tool_formats.py), each
with a minimal template that speaks it (``tests/support/tool_templates.py``)
and the format's parser. For each, a conversation with an earlier call
(rendered in the format) and its result, then ``tool_choice: "required"``:
one valid call comes back. A long argument streams in pieces on all three
APIs (qwen3_coder, harmony).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from mlxd.engine import TOOL_GRAMMAR_FORMATS
from tests.support.daemon import Daemon
from tests.support.tinymodels import tiny_model_dir
from tests.support.tool_templates import CALLS, format_models

# The formats served here (each a model slot: an app stops its engines one by one, about
# a second each). json_tools and mistral have their own modules; laguna is glm47's parser
# and template; kimi_k3, minicpm5 and muse_spark are covered without a model in
# tests/engine/test_tool_formats.py, as every format is.
FORMATS = [
    "function_gemma",
    "gemma4",
    "glm47",
    "harmony",
    "kimi_k2",
    "longcat",
    "minimax_m2",
    "pythonic",
    "qwen3_coder",
]
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
    "add": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
    },
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def app(apps, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("tool-templates")
    models = format_models(tiny_model_dir("llama"), folder, FORMATS)
    return apps.get({"models": models, "batch": {"size": 4, "kv_budget": "64MiB"}})


def chat(app: Daemon, model: str, messages: list[dict[str, Any]], choice: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 160,
    }
    r = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_every_format_with_a_grammar_has_a_template():
    assert set(CALLS) == set(TOOL_GRAMMAR_FORMATS) and set(FORMATS) <= set(CALLS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_round_trips_then_a_required_call_comes_in_the_format(app, fmt):
    earlier = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [earlier]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    choice = chat(app, fmt, messages, "required")
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[name])
    (entry,) = [m for m in httpx.get(f"{app.url}/v1/models").json()["data"] if m["id"] == fmt]
    assert entry["capabilities"]["tool_format"] == fmt
    assert entry["capabilities"]["tool_choice_required"] is True


# ---------------------------------------------------------------- streamed arguments

WRITE = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "minLength": 40, "maxLength": 44},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["path", "n"],
    "additionalProperties": False,
}


def _chat_pieces(app: Daemon, fmt: str) -> tuple[list[str], str]:
    client = app.openai(max_retries=0)
    kw: dict[str, Any] = {
        "model": fmt,
        "messages": [{"role": "user", "content": "write"}],
        "tools": [{"type": "function", "function": {"name": "write", "parameters": WRITE}}],
        "tool_choice": {"type": "function", "function": {"name": "write"}},
        "temperature": 0,
        "max_tokens": 160,
    }
    whole = client.chat.completions.create(**kw)
    (call,) = whole.choices[0].message.tool_calls or []
    pieces = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert c.index == 0
            if c.function is not None and c.function.arguments:
                pieces.append(c.function.arguments)
    return pieces, call.function.arguments


def _messages_pieces(app: Daemon, fmt: str) -> tuple[list[str], str]:
    import anthropic

    claude = anthropic.Anthropic(base_url=app.url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = {
        "model": fmt,
        "max_tokens": 160,
        "extra_body": {"temperature": 0},
        "tools": [{"name": "write", "input_schema": WRITE}],
        "tool_choice": {"type": "tool", "name": "write"},
        "messages": [{"role": "user", "content": "write"}],
    }
    (use,) = [b for b in claude.messages.create(**kw).content if b.type == "tool_use"]
    pieces = [
        e.delta.partial_json
        for e in claude.messages.create(**kw, stream=True)
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    return [p for p in pieces if p], json.dumps(use.input, ensure_ascii=False)


def _responses_pieces(app: Daemon, fmt: str) -> tuple[list[str], str]:
    client = app.openai(max_retries=0)
    kw: dict[str, Any] = {
        "model": fmt,
        "input": "write",
        "tools": [{"type": "function", "name": "write", "parameters": WRITE}],
        "tool_choice": {"type": "function", "name": "write"},
        "temperature": 0,
        "max_output_tokens": 160,
    }
    (call,) = [i for i in client.responses.create(**kw).output if i.type == "function_call"]
    events = list(client.responses.create(**kw, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(pieces)
    return pieces, call.arguments


@pytest.mark.parametrize(
    ("fmt", "api"),
    [
        ("qwen3_coder", _chat_pieces),
        ("qwen3_coder", _messages_pieces),
        ("qwen3_coder", _responses_pieces),
        ("harmony", _chat_pieces),
        ("harmony", _messages_pieces),
        ("harmony", _responses_pieces),
    ],
    ids=[f"{f}-{a}" for f in ("qwen3_coder", "harmony") for a in ("chat", "messages", "responses")],
)
def test_a_long_argument_streams_in_pieces_that_join_to_the_whole_call(app, fmt, api):
    pieces, whole = api(app, fmt)
    assert len(pieces) >= 3, pieces
    joined = "".join(pieces)
    jsonschema.validate(json.loads(joined), WRITE)
    assert json.loads(joined) == json.loads(whole)
    assert joined == whole or api is _messages_pieces  # Messages' input is an object
