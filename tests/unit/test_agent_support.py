"""What makes agents work, in process: the test-only forced call and answer
(:mod:`mlxd.api.forced_tool`), the shipped ``hermes-tools`` template, and each
API's keep-alive while a long prompt is read."""

from __future__ import annotations

import json
from dataclasses import replace

import jinja2
import pytest

from mlxd.api.anthropic.render import MessagesOutput
from mlxd.api.forced_tool import FORCE_ANSWER_ENV, FORCE_TOOL_CALL_ENV, force_tool_call
from mlxd.api.openai.render import Renderer
from mlxd.api.openai.routes import ChatOutput
from mlxd.api.responses.render import ResponsesOutput
from mlxd.engine import ChatPrompt, GenerationRequest
from mlxd.engine.chat.loading import BUILTIN_TEMPLATES
from tests.support.translate import INFO, NO_TOOLS, named_events

BASH = {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}
CALLS = [{"name": "Bash", "arguments": {"command": "pwd"}, "when": "pwd"}]


def _gen(*messages: dict, tools: tuple = (BASH,)) -> GenerationRequest:
    return GenerationRequest(id="r", prompt=ChatPrompt(tuple(messages), tools), max_tokens=8)


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(FORCE_TOOL_CALL_ENV, json.dumps(CALLS))
    monkeypatch.setenv(FORCE_ANSWER_ENV, "done")


def test_the_forced_call_is_exactly_the_configured_one(forced):
    gen = force_tool_call(_gen({"role": "user", "content": "run pwd"}), INFO, enabled=True)
    assert gen.constraint is not None and gen.constraint.kind == "tools" and gen.parse_tools
    ((_, schema),) = gen.constraint.schemas
    assert schema["properties"] == {"command": {"const": "pwd"}}
    assert schema["additionalProperties"] is False


def test_a_forced_custom_call_is_exactly_the_configured_input(monkeypatch):
    from mlxd.engine import CustomTool, template_tool
    from mlxd.engine.custom_tools import input_matches

    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    monkeypatch.setenv(FORCE_TOOL_CALL_ENV, json.dumps([{"name": "apply_patch", "input": patch}]))
    tool = template_tool("apply_patch", None)
    gen = replace(_gen({"role": "user", "content": "edit"}, tools=(tool,)), parse_tools=True)
    # Not a custom tool of this request: nothing forced.
    assert force_tool_call(gen, INFO, enabled=True).constraint is None
    custom = replace(gen, custom_tools=(CustomTool("apply_patch"),))
    c = force_tool_call(custom, INFO, enabled=True).constraint
    assert c is not None and c.kind == "custom" and c.tool == "apply_patch"
    literal = CustomTool("apply_patch", c.grammar)
    assert input_matches(literal, patch) and not input_matches(literal, patch + "x")


def test_the_forced_answer_ends_every_other_turn(forced):
    for gen in (
        _gen({"role": "user", "content": "say hi"}),  # no "pwd" in it
        _gen(
            {"role": "user", "content": "pwd"},
            {"role": "tool", "content": "/", "tool_call_id": "c"},
        ),
        _gen({"role": "user", "content": "run pwd"}, tools=()),
    ):
        got = force_tool_call(gen, INFO, enabled=True)
        assert got.constraint is not None and got.constraint.kind == "json", gen
        assert got.constraint.schemas[0][1] == {"const": "done"}


def test_nothing_is_forced_unless_fault_injection_is_on(forced, monkeypatch):
    gen = _gen({"role": "user", "content": "run pwd"})
    assert force_tool_call(gen, INFO, enabled=False) is gen
    assert force_tool_call(gen, NO_TOOLS, enabled=True) is gen  # no tool parser
    asked = replace(gen, constraint=force_tool_call(gen, INFO, enabled=True).constraint)
    assert force_tool_call(asked, INFO, enabled=True) is asked  # the request's own grammar wins
    monkeypatch.delenv(FORCE_TOOL_CALL_ENV)
    monkeypatch.delenv(FORCE_ANSWER_ENV)
    assert force_tool_call(gen, INFO, enabled=True) is gen


# SmolLM2-135M-Instruct's own template (its tokenizer_config.json).
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _render(template: str, messages: list[dict], tools: list | None = None) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
    env.filters["tojson"] = lambda value: json.dumps(value)
    return env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
    ],
)
def test_hermes_tools_renders_what_smollm2_does_without_tools(messages):
    hermes = BUILTIN_TEMPLATES["hermes-tools"].read_text()
    assert _render(hermes, messages) == _render(SMOLLM2, messages)


def test_hermes_tools_renders_tools_calls_and_results():
    hermes = BUILTIN_TEMPLATES["hermes-tools"].read_text()
    call = {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": {"a": 1}}}
    text = _render(
        hermes,
        [
            {"role": "user", "content": "where?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "/home"},
        ],
        [BASH],
    )
    assert "<tools>\n" + json.dumps(BASH) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "Bash", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\n/home\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_each_api_keeps_a_stream_alive_in_its_own_way():
    messages = MessagesOutput("msg_1", "tiny", 10)
    assert [n for n, _ in named_events(messages.stream_keepalive())] == ["ping"]
    responses = ResponsesOutput("resp_1", "tiny", {})
    responses.stream_start()
    ((name, body),) = named_events(responses.stream_keepalive())
    assert name == "response.in_progress" and body["sequence_number"] == 2
    assert body["response"]["status"] == "in_progress"
    chat = ChatOutput(Renderer("chat", "chatcmpl-1", "tiny", logprobs=False), include_usage=False)
    assert chat.stream_keepalive() == [b": keep-alive\n\n"]
