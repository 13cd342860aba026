"""Tool fields and response formats of chat bodies to the engine's request, in process.

``tools`` reach the chat template in Hugging Face's shape, ``tool_choice`` decides
whether calls are parsed or forced by a grammar in the model's tool format, and
``response_format`` becomes a JSON grammar; every malformed field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.openai.schema import ChatRequest, chat_request
from mlxd.engine import GenerationRequest, ModelInfo
from tests.support.translate import INFO, NO_TOOLS, SETTINGS, chat_prompt, decoded, refused

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "strict": True,
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
CITY = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def chat(info: ModelInfo | None = INFO, faults: bool = False, **body: Any) -> GenerationRequest:
    body.setdefault("model", "tiny")
    body.setdefault("messages", HI)
    return chat_request(decoded(body, ChatRequest), SETTINGS, faults=faults, info=info)


# ---------------------------------------------------------------- chat: tools


def test_auto_tools_reach_the_template_without_strict_and_are_parsed():
    gen = chat(tools=[WEATHER, ADD])
    assert gen.parse_tools is True and gen.constraint is None
    assert chat_prompt(gen).tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["function"]["parameters"],
                "description": "Weather in a city",
            },
        },
        {
            "type": "function",
            "function": {"name": "add", "parameters": ADD["function"]["parameters"]},
        },
    )


def test_tool_choice_none_drops_the_tools():
    gen = chat(tools=[WEATHER], tool_choice="none")
    assert chat_prompt(gen).tools == () and gen.parse_tools is False and gen.constraint is None


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "add"}}],
    ids=["required", "named"],
)
def test_a_forced_call_is_a_grammar_in_the_models_tool_format(choice):
    gen = chat(tools=[WEATHER, ADD], tool_choice=choice)
    assert gen.parse_tools is True and len(chat_prompt(gen).tools) == 2
    assert gen.constraint is not None
    assert gen.constraint.kind == "tools" and gen.constraint.tool_format == "json_tools"
    assert gen.constraint.grammar and gen.constraint.key


def test_a_named_choice_grammar_differs_from_required_and_parallel():
    named = chat(
        tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}
    )
    required = chat(tools=[WEATHER, ADD], tool_choice="required")
    single = chat(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False)
    constraints = [named.constraint, required.constraint, single.constraint]
    assert all(c is not None for c in constraints)
    assert len({c.key for c in constraints if c is not None}) == 3
    assert chat(tools=[WEATHER, ADD], tool_choice="required").constraint == required.constraint


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "w"}}])
def test_forced_tools_for_a_model_without_a_tool_parser(choice):
    tool = {"type": "function", "function": {**WEATHER["function"], "name": "w"}}
    err = refused(chat, info=NO_TOOLS, tools=[tool], tool_choice=choice)
    assert (err.status, err.code, err.param) == (400, "tools_unsupported", "tool_choice")
    assert "'plain' has no tool-call parser" in err.message


@pytest.mark.parametrize("choice", [None, "auto"])
def test_tools_to_a_model_without_a_tool_parser_are_left_out(choice):
    """Open WebUI and agents send tools to every model: served without them, and said so."""
    gen = chat(info=NO_TOOLS, tools=[WEATHER, ADD], tool_choice=choice)
    assert gen.tools_ignored == 2 and gen.parse_tools is False and gen.constraint is None
    assert gen.prompt.tools == ()
    assert chat(tools=[WEATHER]).tools_ignored == 0


def test_a_tool_format_without_a_grammar_refuses_forced_calls_only():
    # Every format mlx-lm parses has a grammar; a parser added after this mlxd has none.
    newer = ModelInfo(**{**INFO.__dict__, "tool_format": "some_newer_format"})
    assert chat(info=newer, tools=[WEATHER]).parse_tools is True
    err = refused(chat, info=newer, tools=[WEATHER], tool_choice="required")
    assert (err.code, err.param) == ("tool_format_unsupported", "tool_choice")


BAD_TOOLS = [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{**WEATHER, "extra": 1}]}, "tools[0]"),
    (
        {"tools": [{"type": "function", "function": {"name": "has space"}}]},
        "tools[0].function.name",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
        "tools[0].function.description",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
        "tools[0].function",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [ADD] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "functions"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_TOOLS)
def test_bad_tool_fields_name_their_param(extra, param):
    err = refused(chat, **extra)
    assert err.status == 400 and err.param == param, err.message
    expected = "unsupported_parameter" if param == "functions" else "invalid_value"
    assert err.code == expected


# ---------------------------------------------------------------- chat: response_format


def test_response_format_grammars():
    assert chat(response_format={"type": "text"}).constraint is None
    obj = chat(response_format={"type": "json_object"}).constraint
    assert obj is not None and obj.kind == "json" and obj.tool_format is None
    schema = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    ).constraint
    strict = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        }
    ).constraint
    assert schema is not None and strict is not None and schema.kind == strict.kind == "json"
    assert len({obj.key, schema.key, strict.key}) == 3


@pytest.mark.parametrize(
    ("fmt", "code", "param"),
    [
        ("json", "invalid_type", "response_format"),
        ({"type": "yaml"}, "invalid_value", "response_format.type"),
        (
            {"type": "json_schema", "json_schema": []},
            "invalid_value",
            "response_format.json_schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": CITY}},
            "invalid_value",
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": CITY, "strict": 1}},
            "invalid_value",
            "response_format.json_schema.strict",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
            "invalid_schema",
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_response_formats(fmt, code, param):
    err = refused(chat, response_format=fmt)
    assert (err.status, err.code, err.param) == (400, code, param), err.message


def test_a_json_format_and_a_forced_call_cannot_both_constrain():
    err = refused(
        chat, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}
    )
    assert (err.code, err.param) == ("invalid_value", "response_format")
    # With the call not forced, the JSON format is the constraint.
    gen = chat(tools=[WEATHER], response_format={"type": "json_object"})
    assert gen.constraint is not None and gen.constraint.kind == "json" and gen.parse_tools
