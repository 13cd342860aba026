"""Enforced calls in every tool-call format, through the real app on a tiny random-weight llama.

One app serves the same tiny model once per format, each with a minimal
template that speaks it (``tests/support/tool_templates.py``) and the
format's mlx-lm parser. For each, a conversation with an earlier call
(rendered in the format) and its result, then ``tool_choice: "required"``:
one valid call comes back. (Named calls and parallel ones in every format:
tests/engine/test_tool_formats.py.)
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

FORMATS = sorted(CALLS)
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


def test_every_parsed_format_has_a_template_here():
    assert set(FORMATS) == set(TOOL_GRAMMAR_FORMATS) - {"harmony"}


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
