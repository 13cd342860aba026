"""gpt-oss's Harmony channels read by mlxd's own reader, fed a character at a time.

analysis -> reasoning, final (and a commentary preamble) -> answer text,
``to=functions.NAME`` -> a tool call whose arguments stream; text that is not
Harmony is answer text; a call that does not parse is sent as text. No model.
"""

from __future__ import annotations

import json
import types

import pytest

from mlxd.engine.chat.harmony import HarmonySplitter, looks_harmony
from mlxd.engine.chat.output import Split
from tests.support.tool_templates import tool_template

THINK = "<|channel|>analysis<|message|>The user wants weather.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "note": "a rather long note to stream"}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"


def run(text: str, *, tools: bool = True) -> tuple[Split, list[Split], HarmonySplitter]:
    splitter = HarmonySplitter(parse_tools=tools)
    splits = [*(splitter.feed(c) for c in text), splitter.finish()]
    total = Split()
    for s in splits:
        total.text += s.text
        total.reasoning += s.reasoning
        total.tool_calls += s.tool_calls
        total.tool_parts += s.tool_parts
    return total, splits, splitter


def test_channels_become_reasoning_calls_and_answer():
    total, splits, splitter = run(THINK + CALL)
    assert total.reasoning == "The user wants weather."
    assert total.text == ""
    (call,) = total.tool_calls
    assert call.name == "get_weather" and call.index == 0
    args = {"city": "Paris", "note": "a rather long note to stream"}
    assert json.loads(call.arguments) == args
    assert "".join(p.arguments for p in total.tool_parts) == call.arguments
    assert len([p for s in splits[:-2] for p in s.tool_parts if p.arguments]) >= 3
    assert splitter.calls == 1

    total, _, _ = run(THINK + FINAL)
    assert (total.reasoning, total.text, total.tool_calls) == (
        "The user wants weather.",
        "It is sunny.",
        [],
    )


def test_text_that_is_not_harmony_is_the_answer():
    total, splits, _ = run("Hello there, no channels here.")
    assert total.text == "Hello there, no channels here." and not total.reasoning
    assert sum(1 for s in splits if s.text) > 3  # streamed, not held to the end


def test_a_call_without_tools_asked_is_text_and_a_broken_call_is_text():
    total, _, _ = run(CALL, tools=False)
    assert not total.tool_calls and '"city": "Paris"' in total.text
    broken = CALL.replace('"Paris",', '"Paris",,')
    total, _, splitter = run(broken)
    assert not total.tool_calls and splitter.failed_calls == 1
    assert "to=functions.get_weather" in total.text


@pytest.mark.parametrize(
    ("template", "harmony"),
    [(tool_template("harmony"), True), (tool_template("qwen3_coder"), False)],
)
def test_a_harmony_template_is_recognized(template, harmony):
    assert looks_harmony(types.SimpleNamespace(chat_template=template)) is harmony
