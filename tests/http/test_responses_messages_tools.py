"""Tools, structured output and reasoning through ``/v1/responses`` and ``/v1/messages``,
with the official SDKs, on tiny random-weight models with tools-capable templates.

A random model never chooses to call a tool or to write JSON, so what is checked
is what mlxd enforces (forced calls, JSON schemas) and how each API renders it:
``function_call`` items and ``tool_use`` blocks whose arguments validate, round
trips with the tool's result, and reasoning returned as reasoning items and
thinking blocks.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.support.daemon import Daemon
from tests.support.daemons import tools_config

MODEL = "tiny-tools"

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}
# The Responses API's flat function tools, and Anthropic's tools.
RESPONSES_TOOLS = [
    {"type": "function", "name": n, "description": f"{n} tool", "parameters": s}
    for n, s in SCHEMAS.items()
]
CLAUDE_TOOLS = [
    {"name": n, "description": f"{n} tool", "input_schema": s} for n, s in SCHEMAS.items()
]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hermes(apps) -> Daemon:
    return apps.get(tools_config("hermes"))


@pytest.fixture(scope="module")
def oai(hermes):
    return hermes.openai(max_retries=0)


@pytest.fixture(scope="module")
def claude(hermes):
    return anthropic.Anthropic(base_url=hermes.url, api_key="unused", max_retries=0)


def _valid(name: str, args: dict[str, Any]) -> None:
    jsonschema.validate(args, SCHEMAS[name])


# ---------------------------------------------------------------- Responses


def test_responses_required_tool_call_validates(oai):
    r = oai.responses.create(
        model=MODEL,
        input="weather?",
        tools=RESPONSES_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    assert r.status == "completed", r
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1
    (call,) = calls
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    _valid(call.name, json.loads(call.arguments))


def test_responses_named_function_and_streamed_call(oai):
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": "add",
        "tools": RESPONSES_TOOLS,
        "tool_choice": {"type": "function", "name": "add"},
        "max_output_tokens": 80,
    }
    whole = oai.responses.create(**kw)
    (call,) = [i for i in whole.output if i.type == "function_call"]
    assert call.name == "add"
    events = list(oai.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    for kind in (
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ):
        assert kind in types, types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and done.name == "add"
    with oai.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    (streamed,) = [i for i in final.output if i.type == "function_call"]
    assert streamed.arguments == call.arguments and streamed.name == "add"


def test_responses_function_call_output_round_trip(oai):
    first = oai.responses.create(
        model=MODEL,
        input="weather?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
    )
    (call,) = [i for i in first.output if i.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    # Stateless, as Codex sends it: the whole conversation each time.
    again = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            result,
        ],
        tools=RESPONSES_TOOLS,
        max_output_tokens=8,
        store=False,
    )
    # With state: the stored turn holds the call; only its result is sent.
    chained = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=RESPONSES_TOOLS,
        max_output_tokens=8,
    )
    assert again.status == chained.status == "incomplete"
    assert again.usage.input_tokens == chained.usage.input_tokens
    assert again.usage.input_tokens > first.usage.input_tokens


def test_responses_json_schema_output_validates(oai):
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    r = oai.responses.create(
        model=MODEL, input="json please", text={"format": fmt}, max_output_tokens=60
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), ANSWER_SCHEMA)
    assert r.text.format.type == "json_schema"


def test_responses_hosted_tools_are_skipped(oai):
    r = oai.responses.create(
        model=MODEL,
        input="hi",
        tools=[{"type": "web_search"}, {"type": "local_shell"}, *RESPONSES_TOOLS],
        tool_choice="required",
        max_output_tokens=80,
    )
    (call,) = [i for i in r.output if i.type == "function_call"][:1]
    assert call.name in SCHEMAS
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(
            model=MODEL, input="hi", tools=[{"type": "web_search"}], tool_choice="required"
        )
    assert err.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", tools=[{"type": "teleport"}])
    assert err.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(
            model=MODEL,
            input="hi",
            tools=[{"type": "web_search"}, {"type": "function", "name": "bad name!"}],
        )
    assert err.value.param == "tools[1].name"  # counted in the request, skipped tools included
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(
            model=MODEL,
            input="hi",
            tools=RESPONSES_TOOLS,
            tool_choice={"type": "function", "name": "nope"},
        )
    assert err.value.param == "tool_choice"


def test_codex_shaped_request_is_served(hermes):
    """The body shape current Codex sends (codex-rs ResponsesApiRequest), streamed."""
    body = {
        "model": MODEL,
        "instructions": "You are a coding agent.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "env"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "run",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                    "required": ["command"],
                },
            },
            {"type": "web_search"},
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "patch",
                "format": {"type": "grammar"},
            },
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": None,
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-session",
        "text": {"verbosity": "medium"},
    }
    with httpx.stream("POST", f"{hermes.url}/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# ---------------------------------------------------------------- Messages


def test_messages_any_gives_a_valid_tool_use(claude):
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=80,
        tools=CLAUDE_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "weather?"}],
    )
    assert msg.stop_reason == "tool_use", msg
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1
    _valid(uses[0].name, uses[0].input)


def test_messages_named_tool_streamed_and_round_trip(claude):
    kw: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 80,
        "tools": CLAUDE_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "weather in Paris?"}],
    }
    whole = claude.messages.create(**kw)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    _valid(use.name, use.input)
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == use.input and final.stop_reason == "tool_use"
    # The tool's result goes back as a tool_result block.
    follow = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=CLAUDE_TOOLS,
        messages=[
            *kw["messages"],
            {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    assert follow.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(
        model=MODEL,
        tools=CLAUDE_TOOLS,
        messages=[
            *kw["messages"],
            {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    assert counted.input_tokens == follow.usage.input_tokens + follow.usage.cache_read_input_tokens


def test_messages_output_format_json_schema(claude):
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "json"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}},
    )
    jsonschema.validate(json.loads(msg.content[0].text), ANSWER_SCHEMA)


def test_messages_bad_tools_are_typed_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=CLAUDE_TOOLS,
            tool_choice={"type": "tool", "name": "nope"},
            messages=[{"role": "user", "content": "x"}],
        )
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=[{"name": "x"}],
            messages=[{"role": "user", "content": "x"}],
        )
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=[
                {"type": "web_search_20250305", "name": "web_search"},
                {"name": "bad name!", "input_schema": {"type": "object"}},
            ],
            messages=[{"role": "user", "content": "x"}],
        )
    assert "tools[1].name" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # tool_result in an assistant turn
        claude.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=[
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]},
                {"role": "user", "content": "y"},
            ],
        )
    # Server tools are skipped: with only those, tool_choice auto is a plain answer.
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}],
        messages=[{"role": "user", "content": "x"}],
    )
    assert msg.stop_reason == "max_tokens"


# ---------------------------------------------------------------- reasoning


@pytest.fixture(scope="module")
def thinker(apps) -> Daemon:
    return apps.get(tools_config("hermes_think"))


def test_reasoning_is_returned_as_reasoning_items_and_thinking_blocks(thinker):
    oai = thinker.openai(max_retries=0)
    r = oai.responses.create(model=MODEL, input="think", max_output_tokens=12)
    kinds = [i.type for i in r.output]
    assert kinds[0] == "reasoning", kinds
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text
    off = oai.responses.create(
        model=MODEL, input="think", max_output_tokens=12, reasoning={"effort": "none"}
    )
    assert [i.type for i in off.output] == ["message"]

    claude = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "think"}],
    }
    msg = claude.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    assert msg.content[0].type == "thinking" and msg.content[0].thinking
    with claude.messages.stream(
        **kw, thinking={"type": "enabled", "budget_tokens": 1024}
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking == msg.content[0].thinking
    plain = claude.messages.create(**kw, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"]


def test_codex_warm_up_and_probes(hermes, oai):
    """Codex's generate=false warm-up prefills and answers with no output; its
    client_metadata and its models probe (with client_version) are accepted."""
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": "warm me up",
        "store": False,
        "extra_body": {"generate": False, "client_metadata": {"x-codex-turn": "1"}},
    }
    r = oai.responses.create(**kw)
    assert r.status == "completed" and r.output == []
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == 1
    events = list(oai.responses.create(**kw, stream=True))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    assert events[-1].response.output == []
    # The warm-up filled the prompt cache: the real turn reuses the prompt.
    real = oai.responses.create(model=MODEL, input="warm me up", max_output_tokens=2, store=False)
    assert real.usage.input_tokens_details.cached_tokens > 0
    models = httpx.get(f"{hermes.url}/v1/models", params={"client_version": "0.99.0"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
