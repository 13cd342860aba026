"""Chat and legacy completion bodies to the engine's ``GenerationRequest``, in process.

Each body goes through the route's own steps (``decode`` then ``chat_request`` or
``completion_request``) with a ``ModelInfo`` and ``Settings`` built here: prompts and
tool history, sampling and penalties, stop strings, token limits, logprobs, and every
refusal with its code and ``param``. Tools and response formats: test_translate_openai_tools.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.http.decode import decode
from mlxd.api.openai.schema import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
)
from mlxd.engine import (
    ChatPrompt,
    GenerationRequest,
    ModelInfo,
    PenaltyParams,
    SamplingParams,
    TextPrompt,
    TokenPrompt,
)
from tests.support.translate import INFO, SETTINGS, body_bytes, chat_prompt, decoded, refused

HI = [{"role": "user", "content": "hi"}]


def chat(info: ModelInfo | None = INFO, faults: bool = False, **body: Any) -> GenerationRequest:
    body.setdefault("model", "tiny")
    body.setdefault("messages", HI)
    return chat_request(decoded(body, ChatRequest), SETTINGS, faults=faults, info=info)


def completion(**body: Any) -> GenerationRequest:
    body.setdefault("model", "tiny")
    return completion_request(decoded(body, CompletionRequest), SETTINGS, info=INFO)


# ---------------------------------------------------------------- chat: the plain request


def test_a_minimal_chat_takes_every_default_from_settings():
    gen = chat()
    assert gen.id.startswith("chatcmpl-") and len(gen.id) == len("chatcmpl-") + 24
    assert gen.prompt == ChatPrompt(({"role": "user", "content": "hi"},), (), ())
    assert gen.max_tokens == 100  # [sampling] max_tokens
    assert gen.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
    assert gen.penalties == PenaltyParams()
    assert gen.stop == () and gen.fault is None
    assert (gen.logprobs, gen.top_logprobs) == (False, 0)
    assert gen.api == "chat" and gen.parse_tools is False and gen.constraint is None


def test_request_values_override_the_defaults():
    gen = chat(
        temperature=0,
        top_p=0.5,
        top_k=3,
        min_p=0.2,
        seed=-1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"17": -100, "3": 2.5},
        max_tokens=7,
    )
    assert gen.max_tokens == 7
    # A negative seed is taken modulo 2**64.
    assert gen.sampling == SamplingParams(0.0, 0.5, 3, 0.2, seed=2**64 - 1)
    assert gen.penalties == PenaltyParams(
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias=((17, -100.0), (3, 2.5)),
    )
    assert gen.penalties.has_penalties


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=9, max_completion_tokens=4).max_tokens == 4
    assert chat(max_tokens=256).max_tokens == 256  # exactly the limit is allowed


def test_max_tokens_above_the_limit_is_clamped_to_it():
    # opencode asks for 32000; the server stops at [limits] max_tokens (256 here).
    gen = chat(max_tokens=32000)
    assert (gen.max_tokens, gen.max_tokens_asked) == (256, 32000)
    assert chat(max_completion_tokens=257).max_tokens == 256
    assert chat(max_tokens=256).max_tokens_asked is None


def test_messages_become_the_template_shape():
    gen = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "system",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": "q", "name": "ann"},
            {"role": "assistant", "content": "a", "refusal": None},
        ]
    )
    assert chat_prompt(gen).messages == (
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    )


def test_tool_history_keeps_calls_and_results():
    gen = chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                    {"type": "function", "function": {"name": "add", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    assert chat_prompt(gen).messages[1:] == (
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
                # No id: one is made from the positions; empty arguments are {}.
                {
                    "id": "call_1_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": {}},
                },
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    )


def test_stop_strings():
    assert chat(stop="END").stop == ("END",)
    assert chat(stop=["a", "", "b"]).stop == ("a", "b")  # empty ones stop nothing
    assert chat(stop=["x"] * 16).stop == ("x",) * 16


def test_logprobs_and_chat_template_kwargs():
    gen = chat(
        logprobs=True, top_logprobs=3, chat_template_kwargs={"enable_thinking": False, "a": 1}
    )
    assert (gen.logprobs, gen.top_logprobs) == (True, 3)
    assert chat_prompt(gen).template_kwargs == (("a", 1), ("enable_thinking", False))


def test_fault_injection_when_the_server_allows_it():
    assert chat(faults=True, mlxd_fault="bad_logits@3").fault == "bad_logits@3"
    assert chat(faults=True, mlxd_fault="logits_processor").fault == "logits_processor"


def test_accepted_and_ignored_fields_change_nothing():
    plain = chat()
    extra = chat(
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        user="u",
        n=1,
        modalities=["text"],
        stream=True,
        stream_options={"include_usage": True},
        parallel_tool_calls=True,
        response_format={"type": "text"},
        tool_choice="none",
    )
    assert extra.prompt == plain.prompt and extra.sampling == plain.sampling
    assert extra.constraint is None and extra.parse_tools is False


# ---------------------------------------------------------------- chat: refusals


BAD_CHAT = [
    ({"n": 2}, "unsupported_parameter", "n"),
    # stream_options only with stream: true (as OpenAI).
    ({"stream_options": {"include_usage": True}}, "invalid_value", "stream_options"),
    (
        {"stream": False, "stream_options": {"include_usage": True}},
        "invalid_value",
        "stream_options",
    ),
    # metadata to OpenAI's bounds: 16 pairs, 64-character keys, 512-character values.
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_value", "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "invalid_value", "metadata"),
    ({"metadata": {"k": "v" * 513}}, "invalid_value", "metadata.k"),
    ({"max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, "invalid_value", "max_tokens"),
    ({"temperature": 2.01}, "invalid_value", "temperature"),
    ({"temperature": -0.1}, "invalid_value", "temperature"),
    ({"top_p": 0}, "invalid_value", "top_p"),
    ({"top_p": 1.5}, "invalid_value", "top_p"),
    ({"min_p": 1.5}, "invalid_value", "min_p"),
    ({"presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
    ({"frequency_penalty": -3}, "invalid_value", "frequency_penalty"),
    ({"repetition_penalty": 0}, "invalid_value", "repetition_penalty"),
    ({"top_k": -1}, "invalid_value", "top_k"),
    ({"seed": 2**64}, "invalid_value", "seed"),
    ({"seed": -(2**63) - 1}, "invalid_value", "seed"),
    ({"logit_bias": {"abc": 1}}, "invalid_value", "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "invalid_value", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "invalid_value", "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "invalid_value", "logit_bias"),
    ({"stop": ["x"] * 17}, "invalid_value", "stop"),
    ({"stop": "x" * 501}, "invalid_value", "stop"),
    ({"top_logprobs": 2}, "invalid_value", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ({"modalities": ["text", "audio"]}, "unsupported_parameter", "modalities"),
    ({"audio": {"voice": "x"}}, "unsupported_parameter", "audio"),
    ({"prediction": {"type": "content"}}, "unsupported_parameter", "prediction"),
    ({"web_search_options": {}}, "unsupported_parameter", "web_search_options"),
    ({"chat_template_kwargs": []}, "invalid_type", "chat_template_kwargs"),
    (
        {"chat_template_kwargs": {"tools": [], "chat_template": "x"}},
        "invalid_value",
        "chat_template_kwargs",
    ),
    ({"mlxd_fault": "bad_logits@3"}, "unknown_parameter", "mlxd_fault"),
    ({"messages": []}, "invalid_value", "messages"),
    ({"messages": ["hi"]}, "invalid_type", "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "invalid_value", "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "invalid_value", "messages[0].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "invalid_value", "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "invalid_image",
        "messages[0].content[0].image_url",
    ),
    ({"messages": [{"role": "user", "content": "x", "when": 1}]}, "invalid_value", "messages[0]"),
    (
        {"messages": [{"role": "assistant", "content": "", "function_call": {"name": "f"}}]},
        "unsupported_parameter",
        "messages[0].function_call",
    ),
    ({"messages": [{"role": "tool", "content": "r"}]}, "invalid_value", "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "invalid_value", "messages[0].content"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        "invalid_value",
        "messages[0].tool_calls[0]",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
            ]
        },
        "invalid_value",
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                }
            ]
        },
        "invalid_value",
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize(("extra", "code", "param"), BAD_CHAT)
def test_bad_chat_values_get_a_400_naming_the_param(extra, code, param):
    err = refused(chat, **extra)
    assert (err.status, err.code, err.param) == (400, code, param), err.message
    assert err.message


def test_a_bad_fault_is_refused_even_when_faults_are_on():
    err = refused(chat, faults=True, mlxd_fault="explode@1")
    assert (err.code, err.param) == ("invalid_value", "mlxd_fault")


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b"[1, 2]", "invalid_json", None),
        (b"null", "invalid_json", None),
        (b"[" * 70 + b"]" * 70, "invalid_json", None),
        (
            b'{"model": "m", "messages": [], "x": ' + b"[" * 64 + b"]" * 64 + b"}",
            "invalid_json",
            None,
        ),
        (b'{"model": "m"}', "missing_required_parameter", "messages"),
        (b'{"model": "m", "messages": [], "temprature": 1}', "unknown_parameter", "temprature"),
        (b'{"model": 1, "messages": []}', "invalid_type", "model"),
        (b'{"model": "m", "messages": [], "max_tokens": "5"}', "invalid_type", "max_tokens"),
        (
            b'{"model": "m", "messages": [], "stream_options": {"usage": true}}',
            "unknown_parameter",
            "usage",
        ),
    ],
)
def test_decode_errors(raw, code, param):
    err = refused(decode, raw, ChatRequest)
    assert (err.status, err.code, err.param) == (400, code, param), err.message


@pytest.mark.parametrize(
    ("raw", "what"),
    [(b"null", "null"), (b"[1]", "an array"), (b"3", "a number"), (b'"x"', "a string")],
)
def test_a_body_that_is_not_an_object_says_so(raw, what):
    err = refused(decode, raw, ChatRequest)
    assert err.message == f"The request body must be a JSON object, not {what}.", err.message
    assert "nests" not in err.message


def test_unknown_parameters_can_be_dropped_and_named():
    ignored: list[str] = []
    body = body_bytes({"model": "m", "messages": HI, "top_a": 1, "mirostat": 2, "n": 1})
    req = decode(body, ChatRequest, ignored=ignored)
    assert ignored == ["top_a", "mirostat"] and req.n == 1
    # Nested objects stay strict.
    bad = body_bytes({"model": "m", "messages": HI, "stream_options": {"x": 1}})
    assert refused(decode, bad, ChatRequest, ignored=[]).code == "unknown_parameter"


# ---------------------------------------------------------------- legacy completions


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("once upon", TextPrompt("once upon")),
        (["once upon"], TextPrompt("once upon")),
        ([1, 2, 3], TokenPrompt((1, 2, 3))),
        ([[4, 5]], TokenPrompt((4, 5))),
    ],
)
def test_completion_prompts(prompt, expected):
    gen = completion(prompt=prompt)
    assert gen.prompt == expected
    assert gen.id.startswith("cmpl-") and gen.api == "completions"
    assert gen.max_tokens == 100 and gen.sampling.temperature == 0.7
    assert (gen.logprobs, gen.top_logprobs, gen.parse_tools) == (False, 0, False)


def test_completion_logprobs_stop_and_json():
    gen = completion(
        prompt="x", logprobs=2, stop=["\n"], max_tokens=8, response_format={"type": "json_object"}
    )
    assert (gen.logprobs, gen.top_logprobs, gen.stop, gen.max_tokens) == (True, 2, ("\n",), 8)
    assert gen.constraint is not None and gen.constraint.kind == "json"
    assert completion(prompt="x", logprobs=0).logprobs is True  # 0: the sampled token only


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"prompt": ""}, "invalid_value", "prompt"),
        ({"prompt": []}, "invalid_value", "prompt"),
        ({"prompt": [[]]}, "invalid_value", "prompt"),
        ({"prompt": ["a", "b"]}, "unsupported_parameter", "prompt"),
        ({"prompt": [[1], [2]]}, "unsupported_parameter", "prompt"),
        ({"prompt": [1, "a"]}, "invalid_value", "prompt"),
        ({"prompt": [True]}, "invalid_value", "prompt"),
        ({"prompt": "x", "echo": True}, "unsupported_parameter", "echo"),
        ({"prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
        ({"prompt": "x", "best_of": 2}, "unsupported_parameter", "best_of"),
        ({"prompt": "x", "logprobs": 6}, "invalid_value", "logprobs"),
        ({"prompt": "x", "n": 3}, "unsupported_parameter", "n"),
        ({"prompt": "x", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ],
)
def test_bad_completions(extra, code, param):
    err = refused(completion, **extra)
    assert (err.status, err.code, err.param) == (400, code, param), err.message


def test_completion_max_tokens_above_the_limit_is_clamped_as_a_chat_is():
    gen = completion(prompt="x", max_tokens=1000)
    assert (gen.max_tokens, gen.max_tokens_asked) == (256, 1000)


def test_completion_fields_a_chat_does_not_know_are_unknown():
    raw = body_bytes({"model": "m", "prompt": "x", "messages": HI})
    assert refused(decode, raw, CompletionRequest).param == "messages"
    raw = body_bytes({"model": "m", "messages": HI, "echo": True})
    assert refused(decode, raw, ChatRequest).param == "echo"


def test_completion_requests_decode_from_raw_bytes():
    req = decode(b'{"model": "m", "prompt": [[7, 8, 9]], "seed": 5}', CompletionRequest)
    assert isinstance(req, CompletionRequest)
    gen = completion_request(req, SETTINGS)
    assert gen.prompt == TokenPrompt((7, 8, 9)) and gen.sampling.seed == 5


def test_model_may_be_absent_and_means_the_default_model():
    """Issue 22: as configuration.md says (and most local servers do), not a 400."""
    assert decode(body_bytes({"messages": HI}), ChatRequest).model == ""


def test_reasoning_effort_is_a_thinking_budget_or_the_switch():
    budgets = SETTINGS.reasoning.effort_budgets
    assert chat(reasoning_effort="low").reasoning_budget == budgets["low"]
    assert chat(reasoning_effort="xhigh").reasoning_budget is None  # not in the table: no cap
    off = chat(reasoning_effort="none")
    assert off.reasoning_budget is None
    assert chat_prompt(off).template_kwargs == (("enable_thinking", False),)
    # The client's own template kwargs win over the effort's switch.
    mine = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert chat_prompt(mine).template_kwargs == (("enable_thinking", True),)
    assert refused(chat, reasoning_effort="lots").param == "reasoning_effort"


def test_custom_tools_reach_the_template_as_one_string_functions():
    tool = {
        "type": "custom",
        "custom": {
            "name": "patch",
            "description": "edit",
            "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": "[a-z]+"}},
        },
    }
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    gen = chat(tools=[tool, fn])
    (seen, _) = chat_prompt(gen).tools
    assert seen == {
        "type": "function",
        "function": {
            "name": "patch",
            "description": "edit",
            "parameters": {
                "type": "object",
                "properties": {"input": {"type": "string"}},
                "required": ["input"],
            },
        },
    }
    assert [t.name for t in gen.custom_tools] == ["patch"] and gen.constraint is None
    named = chat(tools=[tool, fn], tool_choice={"type": "custom", "custom": {"name": "patch"}})
    assert named.constraint is not None and named.constraint.kind == "custom"
    assert named.constraint.tool == "patch"
    # required over several tools: the model's own call format, the input any string.
    required = chat(tools=[tool, fn], tool_choice="required")
    assert required.constraint is not None and required.constraint.kind == "tools"
    broken = {"type": "custom", "custom": {"name": "p", "format": {"type": "grammar"}}}
    assert chat(tools=[broken]).custom_tools[0].grammar is None  # no grammar: any text
    bad = {**tool, "custom": {**tool["custom"], "format": {"type": "xml"}}}
    assert refused(chat, tools=[bad]).param == "tools[0].custom.format.type"
