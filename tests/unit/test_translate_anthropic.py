"""``POST /v1/messages`` (and ``count_tokens``) bodies to the engine's request, in process.

``system`` and content blocks become the chat path's messages (tool_use blocks its
tool calls, tool_result blocks tool messages), Anthropic tools and ``tool_choice``
its tools and grammars, ``output_config.format`` a JSON grammar, ``thinking`` the
template switch; refusals name the parameter as the Messages API spells it.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.anthropic.schema import (
    CountTokensRequest,
    MessagesCall,
    MessagesRequest,
    count_tokens_request,
    messages_request,
)
from mlxd.engine import ChatPrompt, ModelInfo, SamplingParams
from tests.support.translate import INFO, NO_TOOLS, SETTINGS, chat_prompt, decoded, refused

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ADD = {"name": "add", "input_schema": {"type": "object", "properties": {}}, "strict": True}
CITY = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def call(info: ModelInfo | None = INFO, faults: bool = False, **body: Any) -> MessagesCall:
    body.setdefault("model", "tiny")
    body.setdefault("messages", HI)
    body.setdefault("max_tokens", 50)
    return messages_request(decoded(body, MessagesRequest), SETTINGS, faults=faults, info=info)


def test_a_minimal_message():
    c = call()
    gen = c.gen
    assert gen.id.startswith("msg_") and gen.api == "messages" and c.stream is False
    assert gen.prompt == ChatPrompt(({"role": "user", "content": "hi"},), (), ())
    assert gen.max_tokens == 50  # required by the API: no default applies
    assert gen.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
    assert gen.stop == () and gen.constraint is None and gen.parse_tools is False


def test_sampling_stop_sequences_and_stream():
    c = call(temperature=1, top_p=0.5, top_k=5, stop_sequences=["\n\nHuman:", ""], stream=True)
    assert c.gen.sampling == SamplingParams(1.0, 0.5, 5, 0.05)
    assert c.gen.stop == ("\n\nHuman:",) and c.stream is True


def test_system_as_text_or_blocks_and_ignored_cache_control():
    blocks = [
        {"type": "text", "text": "be ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "brief"},
    ]
    a = chat_prompt(call(system="be brief").gen)
    b = chat_prompt(
        call(system=blocks, cache_control={"type": "ephemeral"}, metadata={"user_id": "u"}).gen
    )
    assert a == b
    assert a.messages[0] == {"role": "system", "content": "be brief"}
    assert chat_prompt(call(system="").gen).messages == ({"role": "user", "content": "hi"},)


def test_a_tool_round_trip_becomes_chat_history():
    c = call(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                    {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        ]
    )
    assert chat_prompt(c.gen).messages == (
        {"role": "user", "content": "weather?"},
        # The thinking block is not fed back.
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
                {"id": "toolu_2", "type": "function", "function": {"name": "add", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: no", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "and now?"},
    )


def test_tools_and_tool_choice():
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    gen = call(tools=[server_tool, WEATHER, ADD]).gen
    assert gen.parse_tools is True and gen.constraint is None
    assert chat_prompt(gen).tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather in a city",
            },
        },
        {"type": "function", "function": {"name": "add", "parameters": ADD["input_schema"]}},
    )
    assert call(tools=[WEATHER], tool_choice={"type": "auto"}).gen.constraint is None
    none = call(tools=[WEATHER], tool_choice={"type": "none"}).gen
    assert chat_prompt(none).tools == () and none.parse_tools is False
    for choice in ({"type": "any"}, {"type": "tool", "name": "add"}):
        forced = call(tools=[WEATHER, ADD], tool_choice=choice).gen.constraint
        assert forced is not None and forced.kind == "tools" and forced.tool_format == "json_tools"
    many = call(tools=[WEATHER, ADD], tool_choice={"type": "any"}).gen.constraint
    one = call(
        tools=[WEATHER, ADD], tool_choice={"type": "any", "disable_parallel_tool_use": True}
    ).gen.constraint
    assert many is not None and one is not None and many.key != one.key


def test_output_format_and_thinking():
    fmt = call(output_config={"format": {"type": "json_schema", "schema": CITY}}).gen.constraint
    assert fmt is not None and fmt.kind == "json"
    assert call(output_config={"effort": "low"}).gen.constraint is None
    kwargs = {
        kind: chat_prompt(call(thinking={"type": kind, "budget_tokens": 1024}).gen).template_kwargs
        for kind in ("enabled", "adaptive", "disabled")
    }
    assert kwargs == {
        "enabled": (("enable_thinking", True),),
        "adaptive": (("enable_thinking", True),),
        "disabled": (("enable_thinking", False),),
    }


def test_thinking_budgets():
    budgets = SETTINGS.reasoning.effort_budgets
    assert call(thinking={"type": "enabled", "budget_tokens": 64}).gen.reasoning_budget == 64
    assert call(output_config={"effort": "low"}).gen.reasoning_budget == budgets["low"]
    both = call(thinking={"type": "enabled", "budget_tokens": 9}, output_config={"effort": "high"})
    assert both.gen.reasoning_budget == 9  # budget_tokens wins
    assert call(thinking={"type": "disabled"}).gen.reasoning_budget is None
    assert call().gen.reasoning_budget is None
    for bad in ({"type": "enabled", "budget_tokens": 0}, {"type": "enabled", "budget_tokens": "x"}):
        assert refused(call, thinking=bad).param == "thinking.budget_tokens"
    assert refused(call, output_config={"effort": "huge"}).param == "output_config.effort"


def test_faults_when_the_server_allows_them():
    assert call(faults=True, mlxd_fault="bad_logits@1").gen.fault == "bad_logits@1"


def test_count_tokens_builds_the_same_prompt():
    body = {
        "model": "tiny",
        "messages": HI,
        "system": "s",
        "tools": [WEATHER],
        "thinking": {"type": "disabled"},
    }
    gen = count_tokens_request(decoded(body, CountTokensRequest), SETTINGS, info=INFO)
    assert gen.id.startswith("count_") and gen.max_tokens == 1 and gen.api == "messages"
    assert gen.prompt == call(system="s", tools=[WEATHER], thinking={"type": "disabled"}).gen.prompt
    err = refused(
        count_tokens_request, decoded({"model": "t", "messages": []}, CountTokensRequest), SETTINGS
    )
    assert (err.code, err.param) == ("invalid_value", "messages")


def test_max_tokens_above_the_limit_is_clamped_to_it():
    # Claude Code asks for 32000; the server stops at [limits] max_tokens (256 here).
    assert call(max_tokens=32000).gen.max_tokens == SETTINGS.limits.max_tokens == 256
    assert call(max_tokens=32000).gen.max_tokens_asked == 32000  # X-Mlxd-Max-Tokens
    assert call(max_tokens=256).gen.max_tokens == 256


def test_leading_system_messages_join_the_system_prompt():
    msgs = [
        {"role": "system", "content": "more rules"},
        {"role": "system", "content": [{"type": "text", "text": "and these"}]},
        *HI,
    ]
    got = chat_prompt(call(system="be brief", messages=msgs).gen).messages
    assert got == (
        {"role": "system", "content": "be brief\n\nmore rules\n\nand these"},
        {"role": "user", "content": "hi"},
    )
    alone = chat_prompt(call(messages=msgs).gen).messages
    assert alone[0] == {"role": "system", "content": "more rules\n\nand these"}


def test_later_system_messages_stay_where_they_were_sent():
    """Claude Code's mid-conversation system messages: never hoisted to the front
    (that would change the prompt's start every turn and lose the prefix cache)."""
    first = [
        {"role": "user", "content": "go"},
        {"role": "system", "content": "tokens left: 900"},
    ]
    got = chat_prompt(call(system="S", messages=first).gen).messages
    reminder = "<system-reminder>\ntokens left: 900\n</system-reminder>"
    assert got == (
        {"role": "system", "content": "S"},
        {"role": "user", "content": f"go\n\n{reminder}"},
    )
    # The next turn renders the earlier ones exactly as before: a prefix of it.
    later = [
        *first,
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "note"},
        {"role": "user", "content": "again"},
    ]
    got2 = chat_prompt(call(system="S", messages=later).gen).messages
    assert got2[: len(got)] == got
    assert got2[len(got) :] == (
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "<system-reminder>\nnote\n</system-reminder>\n\nagain"},
    )


CALL = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}

BAD = [
    ({"max_tokens": 0}, "invalid_value", "max_tokens"),
    # A content list holds blocks, never bare strings (as Anthropic).
    (
        {"messages": [{"role": "user", "content": ["hi"]}]},
        "invalid_value",
        "messages[0].content[0]",
    ),
    ({"system": ["be brief"]}, "invalid_type", "system[0]"),
    # A tool_result answers a tool_use of the assistant message just before it.
    ({"messages": [{"role": "user", "content": [RESULT]}]}, "invalid_value", "messages[0].content"),
    (
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{**CALL, "id": "toolu_2"}]},
                {"role": "user", "content": [RESULT]},
            ]
        },
        "invalid_value",
        "messages[2].content",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": [RESULT]},
                {"role": "assistant", "content": "done"},
                {"role": "user", "content": [RESULT]},  # answered already, two turns ago
            ]
        },
        "invalid_value",
        "messages[4].content",
    ),
    ({"metadata": {"user_id": "u" * 257}}, "invalid_value", "metadata.user_id"),
    ({"metadata": {"user_id": 3}}, "invalid_value", "metadata.user_id"),
    ({"metadata": {"tenant": "t"}}, "invalid_value", "metadata.tenant"),
    ({"temperature": 1.5}, "invalid_value", "temperature"),
    ({"temperature": 2.5}, "invalid_value", "temperature"),
    ({"top_p": 0}, "invalid_value", "top_p"),
    ({"top_k": -1}, "invalid_value", "top_k"),
    ({"stop_sequences": ["x"] * 17}, "invalid_value", "stop_sequences"),
    ({"container": "c"}, "unsupported_parameter", "container"),
    ({"mcp_servers": [{"url": "x"}]}, "unsupported_parameter", "mcp_servers"),
    ({"mlxd_fault": "bad_logits"}, "invalid_value", "mlxd_fault"),
    ({"messages": []}, "invalid_value", "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "invalid_value", "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "invalid_value", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "invalid_value", "messages[0]"),
    ({"messages": [{"role": "user", "content": 3}]}, "invalid_value", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [3]}]}, "invalid_value", "messages[0].content[0]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "invalid_value",
        "messages[0].content[0].source.type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
        "invalid_value",
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "invalid_value",
        "messages[0].content[0].text",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        "invalid_value",
        "messages[0].content[0]",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                *HI,
            ]
        },
        "invalid_value",
        "messages[0].content[0]",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]},
        "invalid_value",
        "messages[0].content[0].tool_use_id",
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}, *HI]},
        "invalid_value",
        "messages[0].content[0]",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "server_tool_use"}]}]},
        "unsupported_parameter",
        "messages[0].content[0]",
    ),
    # A final assistant turn (prefill) is not continued.
    (
        {"messages": [*HI, {"role": "assistant", "content": "The"}]},
        "unsupported_parameter",
        "messages[1]",
    ),
    ({"tools": [{"name": "f"}]}, "invalid_value", "tools[0].input_schema"),
    (
        {
            "tools": [
                {"type": "web_search_20250305", "name": "w"},
                {"name": "a b", "input_schema": {}},
            ]
        },
        "invalid_value",
        "tools[1].name",
    ),
    ({"tools": [WEATHER, WEATHER]}, "invalid_value", "tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "sometimes"}},
        "invalid_value",
        "tool_choice.type",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        "invalid_value",
        "tool_choice",
    ),
    ({"tool_choice": {"type": "any"}}, "invalid_value", "tool_choice"),
    (
        {"output_config": {"format": {"type": "json_object"}}},
        "invalid_value",
        "output_config.format",
    ),
    (
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
        "invalid_schema",
        "output_config.format.schema",
    ),
    (
        {
            "output_config": {"format": {"type": "json_schema", "schema": CITY}},
            "tools": [WEATHER],
            "tool_choice": {"type": "any"},
        },
        "invalid_value",
        "output_config.format",
    ),
    ({"thinking": {"type": "on"}}, "invalid_value", "thinking.type"),
]


@pytest.mark.parametrize(("extra", "code", "param"), BAD)
def test_bad_messages_get_a_400_naming_the_param(extra, code, param):
    err = refused(call, **extra)
    assert (err.status, err.code, err.param) == (400, code, param), err.message


def test_unknown_and_missing_fields_are_refused_by_the_decoder():
    for body, code, param in [
        ({"model": "t", "messages": HI}, "missing_required_parameter", "max_tokens"),
        ({"model": "t", "messages": HI, "max_tokens": 5, "n": 2}, "unknown_parameter", "n"),
        (
            {"model": "t", "messages": HI, "max_tokens": 5, "tool_choice": "auto"},
            "invalid_type",
            "tool_choice",
        ),
    ]:
        err = refused(decoded, body, MessagesRequest)
        assert (err.code, err.param) == (code, param), err.message
    # count_tokens takes only the prompt's fields.
    err = refused(decoded, {"model": "t", "messages": HI, "max_tokens": 5}, CountTokensRequest)
    assert (err.code, err.param) == ("unknown_parameter", "max_tokens")


def test_tools_for_a_model_without_a_parser():
    gen = call(info=NO_TOOLS, tools=[WEATHER]).gen
    assert gen.tools_ignored == 1 and gen.prompt.tools == () and gen.parse_tools is False
    err = refused(call, info=NO_TOOLS, tools=[WEATHER], tool_choice={"type": "any"})
    assert (err.code, err.param) == ("tools_unsupported", "tool_choice")
