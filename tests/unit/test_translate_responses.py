"""``POST /v1/responses`` bodies to the engine's ``GenerationRequest``, in process.

``input`` items become the chat path's messages, function tools its tools,
``text.format`` its grammars, ``reasoning.effort`` a template switch; errors
name the parameter as the Responses API spells it (``input[2]``, ``tools[1].name``,
``text.format``), not as the chat code they are checked by.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.responses.items import SKIPPED_TOOL_TYPES
from mlxd.api.responses.schema import ResponsesCall, ResponsesRequest, responses_request
from mlxd.engine import ChatPrompt, ModelInfo, SamplingParams
from tests.support.translate import INFO, NO_TOOLS, SETTINGS, chat_prompt, decoded, refused

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ADD = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}
CITY = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def call(
    previous: tuple[dict, ...] = (),
    *,
    info: ModelInfo | None = INFO,
    faults: bool = False,
    **body: Any,
) -> ResponsesCall:
    body.setdefault("model", "tiny")
    body.setdefault("input", "hi")
    req = decoded(body, ResponsesRequest)
    return responses_request(req, SETTINGS, previous, faults=faults, info=info)


def test_a_string_input_is_one_user_message():
    c = call()
    gen = c.gen
    assert gen.id.startswith("resp_") and gen.api == "responses"
    assert gen.prompt == ChatPrompt(({"role": "user", "content": "hi"},), (), ())
    assert gen.max_tokens == 100  # [sampling] max_tokens
    # Responses has no top_k / min_p: the server's defaults apply.
    assert gen.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
    assert gen.stop == () and gen.constraint is None and gen.parse_tools is False
    assert c.history == ({"role": "user", "content": "hi"},)
    assert (c.store, c.stream, c.generate) == (True, False, True)


def test_the_echo_repeats_the_request_as_a_response_object_does():
    c = call(
        instructions="be brief",
        temperature=0.2,
        max_output_tokens=30,
        metadata={"k": "v"},
        store=False,
        stream=True,
        tools=[WEATHER, {"type": "web_search"}],
        parallel_tool_calls=False,
        reasoning={"effort": "low"},
        user="u1",
    )
    assert (c.store, c.stream, c.gen.max_tokens) == (False, True, 30)
    assert c.echo == {
        "instructions": "be brief",
        "max_output_tokens": 30,
        "metadata": {"k": "v"},
        "parallel_tool_calls": False,
        "previous_response_id": None,
        "reasoning": {"effort": "low", "summary": None},
        "store": False,
        "temperature": 0.2,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [WEATHER],  # hosted tools are not echoed
        "top_p": 0.9,
        "truncation": "disabled",
        "user": "u1",
        "background": False,
        "service_tier": "default",
    }


def test_instructions_lead_the_prompt_but_not_the_stored_history():
    previous = ({"role": "user", "content": "one"}, {"role": "assistant", "content": "1"})
    c = call(previous, instructions="count", input="two")
    assert chat_prompt(c.gen).messages == (
        {"role": "system", "content": "count"},
        *previous,
        {"role": "user", "content": "two"},
    )
    assert c.history == (*previous, {"role": "user", "content": "two"})


def test_items_become_chat_messages():
    c = call(
        input=[
            {"role": "developer", "content": "rules"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, "b"],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "c"},
                    {"type": "refusal", "refusal": "!"},
                ],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "add"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "3"}],
            },
        ]
    )
    assert chat_prompt(c.gen).messages == (
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        # The calls join the assistant turn before them; the reasoning item is skipped.
        {
            "role": "assistant",
            "content": "c!",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "3", "tool_call_id": "c2"},
    )


def test_a_call_with_no_assistant_turn_before_it_opens_one():
    item = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    c = call(input=[item, {"type": "function_call_output", "call_id": "c1", "output": "0"}])
    assert chat_prompt(c.gen).messages[0] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {}}}
        ],
    }


def test_function_tools_and_hosted_tools():
    c = call(tools=[{"type": "web_search"}, WEATHER, {"type": "mcp", "server_label": "x"}])
    assert c.gen.parse_tools is True and c.gen.constraint is None
    assert chat_prompt(c.gen).tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["parameters"],
            },
        },
    )
    assert "web_search" in SKIPPED_TOOL_TYPES and "function" not in SKIPPED_TOOL_TYPES
    # Only hosted tools: nothing for the template, nothing to parse.
    only_hosted = call(tools=[{"type": "code_interpreter"}])
    assert chat_prompt(only_hosted.gen).tools == () and only_hosted.gen.parse_tools is False


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "add"}], ids=["required", "named"]
)
def test_forced_calls_are_grammars(choice):
    gen = call(tools=[WEATHER, ADD], tool_choice=choice).gen
    assert gen.constraint is not None and gen.constraint.kind == "tools"
    assert gen.constraint.tool_format == "json_tools"


def test_text_format_grammars():
    assert call(text={"format": {"type": "text"}}).gen.constraint is None
    assert call(text={}).gen.constraint is None
    obj = call(text={"format": {"type": "json_object"}}).gen.constraint
    schema = call(
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    )
    assert obj is not None and obj.kind == "json"
    assert schema.gen.constraint is not None and schema.gen.constraint.kind == "json"
    assert schema.gen.constraint.key != obj.key
    assert schema.echo["text"] == {
        "format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    }


def test_reasoning_effort_none_turns_thinking_off():
    assert chat_prompt(call(reasoning={"effort": "none"}).gen).template_kwargs == (
        ("enable_thinking", False),
    )
    assert chat_prompt(call(reasoning={"effort": "high"}).gen).template_kwargs == ()


def test_reasoning_effort_is_a_thinking_budget():
    budgets = SETTINGS.reasoning.effort_budgets
    assert call(reasoning={"effort": "medium"}).gen.reasoning_budget == budgets["medium"]
    assert call(reasoning={"effort": "none"}).gen.reasoning_budget is None
    assert call(reasoning={"summary": "auto"}).gen.reasoning_budget is None
    assert refused(call, reasoning={"effort": "extreme"}).param == "reasoning.effort"


def test_a_warm_up_generates_one_token_and_no_output():
    c = call(generate=False, max_output_tokens=50)
    assert (c.gen.max_tokens, c.generate) == (1, False)


def test_max_output_tokens_above_the_limit_is_clamped_to_it():
    gen = call(max_output_tokens=32000).gen
    assert (gen.max_tokens, gen.max_tokens_asked) == (256, 32000)


def test_faults_and_ignored_fields():
    assert call(faults=True, mlxd_fault="logits_processor@2").gen.fault == "logits_processor@2"
    c = call(
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        safety_identifier="s",
        service_tier="flex",
        max_tool_calls=3,
        truncation="disabled",
        top_logprobs=0,
        background=False,
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    assert c.gen.prompt == call().gen.prompt


BAD = [
    ({"input": []}, "invalid_value", "input"),
    ({"input": None}, "invalid_value", "input"),
    ({"input": ["hi"]}, "invalid_type", "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "input[0].role"),
    ({"input": [{"role": "user"}]}, "invalid_value", "input[0].content"),
    ({"input": [{"role": "user", "content": 3}]}, "invalid_value", "input[0].content"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "invalid_image",
        "input[0].content[0].image_url",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "video"}]}]},
        "invalid_value",
        "input[0].content[0]",
    ),
    ({"input": [{"role": "user", "content": [3]}]}, "invalid_value", "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "unsupported_parameter", "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "invalid_value", "input[0]"),
    (
        {"input": [{"type": "function_call_output", "output": "r"}]},
        "invalid_value",
        "input[0].call_id",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
        "invalid_value",
        "input[0].tool_calls[0].function.arguments",
    ),
    ({"tools": [{"type": "browser"}]}, "unsupported_parameter", "tools[0].type"),
    ({"tools": [{**WEATHER, "function": {}}]}, "invalid_value", "tools[0]"),
    # Named as the request names it, past the hosted tools the chat path never saw.
    (
        {"tools": [{"type": "web_search"}, {"type": "function", "name": "a b"}]},
        "invalid_value",
        "tools[1].name",
    ),
    (
        {
            "tools": [
                {"type": "web_search"},
                {"type": "function", "name": "f", "parameters": {"type": "array"}},
            ]
        },
        "invalid_value",
        "tools[1].parameters",
    ),
    ({"tools": [WEATHER, WEATHER]}, "invalid_value", "tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "web_search"}},
        "unsupported_parameter",
        "tool_choice",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        "invalid_value",
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
    ({"text": {"format": "json"}}, "invalid_value", "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "invalid_value", "text.format.type"),
    (
        {"text": {"format": {"type": "json_schema", "name": "bad name", "schema": CITY}}},
        "invalid_value",
        "text.format.name",
    ),
    (
        {"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
        "invalid_schema",
        "text.format.schema",
    ),
    (
        {
            "text": {"format": {"type": "json_object"}},
            "tools": [WEATHER],
            "tool_choice": "required",
        },
        "invalid_value",
        "text.format",
    ),
    ({"max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
    ({"max_output_tokens": -1}, "invalid_value", "max_output_tokens"),
    ({"temperature": 2.5}, "invalid_value", "temperature"),
    ({"top_p": 0}, "invalid_value", "top_p"),
    ({"background": True}, "unsupported_parameter", "background"),
    ({"conversation": "conv_1"}, "unsupported_parameter", "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "unsupported_parameter", "prompt"),
    ({"top_logprobs": 2}, "unsupported_parameter", "top_logprobs"),
    ({"truncation": "auto"}, "unsupported_parameter", "truncation"),
    ({"mlxd_fault": "bad_logits"}, "unknown_parameter", "mlxd_fault"),
    ({"seed": 1}, "unknown_parameter", "seed"),
    # A text part whose text is not a string says so (not "use 'input_text'").
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 123}]}]},
        "invalid_value",
        "input[0].content[0].text",
    ),
    ({"stream_options": {"include_obfuscation": False}}, "invalid_value", "stream_options"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_value", "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "invalid_value", "metadata"),
    ({"metadata": {"k": "v" * 513}}, "invalid_value", "metadata.k"),
]


@pytest.mark.parametrize(("extra", "code", "param"), BAD)
def test_bad_responses_get_a_400_naming_the_param(extra, code, param):
    err = refused(call, **extra)
    assert (err.status, err.code, err.param) == (400, code, param), err.message


def test_relabelled_messages_speak_of_the_responses_names():
    err = refused(call, tools=[{"type": "web_search"}, {"type": "function", "name": "a b"}])
    assert err.message.startswith("tools[1].name must be") and "function" not in err.message
    err = refused(call, text={"format": {"type": "json_schema", "schema": CITY, "strict": 1}})
    assert err.param == "text.format.strict"


def test_tools_for_a_model_without_a_parser():
    gen = call(info=NO_TOOLS, tools=[WEATHER]).gen
    assert gen.tools_ignored == 1 and gen.prompt.tools == () and gen.parse_tools is False
    err = refused(call, info=NO_TOOLS, tools=[WEATHER], tool_choice="required")
    assert (err.code, err.param) == ("tools_unsupported", "tool_choice")
    # Hosted tools alone ask nothing of the model.
    assert call(info=NO_TOOLS, tools=[{"type": "web_search"}]).gen.parse_tools is False
