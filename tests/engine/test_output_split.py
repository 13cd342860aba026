"""mlxd's streaming splitter (answer / reasoning / tool calls) and tools-capable templates.

Real tokenizers of the tiny models' template variants, mlx-lm's own parsers and
text state machine; no model weights are run. Every text goes through the
splitter cut at every chunk offset, so markers split across chunks are covered.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.chat.output import OutputSplitter, Split, initial_phase
from tests.support.tinymodels import tiny_model_dir


@pytest.fixture(scope="module")
def tokenizers():
    cache = {}

    def get(template: str):
        if template not in cache:
            if template == "pythonic":  # mlx-lm's pythonic parser named explicitly
                path = Path(tiny_model_dir("llama"))
                extra = {"tool_parser_type": "pythonic"}
                cache[template] = load_tokenizer(path, tokenizer_config_extra=extra)
            else:
                cache[template] = load_tokenizer(Path(tiny_model_dir("llama", template=template)))
        return cache[template]

    return get


def run(splitter: OutputSplitter, chunks: list[str]) -> Split:
    total = Split()
    for piece in [*[splitter.feed(c) for c in chunks], splitter.finish()]:
        total.text += piece.text
        total.reasoning += piece.reasoning
        total.tool_calls.extend(piece.tool_calls)
    return total


def every_cut(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every offset."""
    cuts = [[text], list(text)]
    cuts += [[text[:i], text[i:]] for i in range(1, len(text))]
    return cuts


def calls(split: Split) -> list[tuple[int, str, dict]]:
    return [(c.index, c.name, json.loads(c.arguments)) for c in split.tool_calls]


CASES = {
    "hermes": [
        (
            "Sure.<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Sure.",
            [(0, "get_weather", {"city": "Paris"})],
        ),
        (
            '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"y": "<z>"}}\n</tool_call>',
            "\n",
            [(0, "a", {"x": 1}), (1, "b", {"y": "<z>"})],
        ),
        ("no call here, only <tool text", "no call here, only <tool text", []),
    ],
    "mistral": [
        (
            'Ok[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
            "Ok",
            [(0, "get_weather", {"city": "Oslo"})],
        ),
        (
            '[TOOL_CALLS]a[ARGS]{"x": 1}b[ARGS]{"y": [1, 2]}',
            "",
            [(0, "a", {"x": 1}), (1, "b", {"y": [1, 2]})],
        ),
    ],
    "pythonic": [
        (
            'Let me check.<|tool_call_start|>[get_weather(city="Rome", days=2)]<|tool_call_end|>',
            "Let me check.",
            [(0, "get_weather", {"city": "Rome", "days": 2})],
        ),
        (
            "<|tool_call_start|>[a(x=1), b(y=[1, 2])]<|tool_call_end|> done",
            " done",
            [(0, "a", {"x": 1}), (1, "b", {"y": [1, 2]})],
        ),
    ],
}


@pytest.mark.parametrize(
    ("template", "text", "content", "expected"),
    [(t, *case) for t, cases in CASES.items() for case in cases],
    ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None,
)
def test_tool_calls_split_at_every_chunk_offset(tokenizers, template, text, content, expected):
    tok = tokenizers(template)
    for chunks in every_cut(text):
        out = run(OutputSplitter(tok, parse_tools=True), chunks)
        assert out.text == content, chunks
        assert calls(out) == expected, chunks
        assert out.reasoning == ""
        assert all(c.id.startswith("call_") for c in out.tool_calls)


def test_without_tools_requested_markers_stay_text(tokenizers):
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    out = run(OutputSplitter(tokenizers("hermes"), parse_tools=False), [text])
    assert out.text == text and not out.tool_calls


def test_a_call_cut_by_max_tokens_is_sent_as_text(tokenizers):
    text = 'Hi<tool_call>\n{"name": "get_weather", "argum'
    for chunks in every_cut(text):
        splitter = OutputSplitter(tokenizers("hermes"), parse_tools=True)
        out = run(splitter, chunks)
        assert out.tool_calls == []
        assert out.text == text, chunks
        assert splitter.failed_calls == 1


def test_a_call_that_fails_to_parse_is_text_and_counted(tokenizers):
    text = (
        "A<tool_call>\nnot json at all\n</tool_call>"
        'B<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    splitter = OutputSplitter(tokenizers("hermes"), parse_tools=True)
    out = run(splitter, [text])
    assert out.text == "A<tool_call>\nnot json at all\n</tool_call>B"
    assert calls(out) == [(0, "f", {})]
    assert splitter.failed_calls == 1 and splitter.calls == 1


def test_reasoning_is_split_from_the_answer_at_every_offset(tokenizers):
    tok = tokenizers("hermes_think")
    assert tok.has_thinking
    text = (
        'I should look.</think>Here<tool_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_call>'
    )
    for chunks in every_cut(text):
        out = run(OutputSplitter(tok, parse_tools=True, initial="reasoning"), chunks)
        assert out.reasoning == "I should look."
        assert out.text == "Here"
        assert calls(out) == [(0, "f", {"q": 1})]


def test_think_markers_in_the_answer_open_a_reasoning_segment(tokenizers):
    text = "a<think>b</think>c"
    for chunks in every_cut(text):
        out = run(OutputSplitter(tokenizers("hermes_think")), chunks)
        assert (out.text, out.reasoning) == ("ac", "b")


def test_raw_completions_are_not_split(tokenizers):
    text = "x<think>y</think>z"
    out = run(OutputSplitter(tokenizers("hermes_think"), reasoning=False), [text])
    assert out.text == text and out.reasoning == ""


# ---------------------------------------------------------------- templates

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.mark.parametrize(
    ("template", "parser", "call_text"),
    [
        ("hermes", "json_tools", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        ("mistral", "mistral", 'get_weather[ARGS]{"city": "Paris"}'),
    ],
)
def test_templates_render_tools_and_tool_results(tokenizers, template, parser, call_text):
    tok = tokenizers(template)
    assert tok.has_tool_calling
    assert tok.init_kwargs["tool_parser_type"] == parser
    text = tok.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "Current weather in a city" in text
    assert call_text in text
    assert "sunny, 21 C" in text
    plain = tok.apply_chat_template(HISTORY[:1], add_generation_prompt=True, tokenize=False)
    assert "Current weather" not in plain


def test_enable_thinking_reaches_the_template_and_sets_the_starting_phase(tokenizers):
    tok = tokenizers("hermes_think")
    msgs = [{"role": "user", "content": "hi"}]
    thinking = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert initial_phase(tok, thinking) == "reasoning"
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    assert initial_phase(tok, off) == "normal"


def test_a_chosen_custom_call_is_checked_against_its_grammar(tokenizers):
    from mlxd.engine import CustomTool, custom_grammar

    word = CustomTool("word", custom_grammar("regex", "[a-z]+", param="format"))
    good = '<tool_call>\n{"name": "word", "arguments": {"input": "hello"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "word", "arguments": {"input": "Hi there"}}\n</tool_call>'
    splitter = OutputSplitter(tokenizers("hermes"), parse_tools=True, custom=(word,))
    out = run(splitter, [good + bad])
    assert [(c.name, c.input) for c in out.tool_calls] == [("word", "hello")]
    assert out.text == bad and splitter.failed_calls == 1


def test_a_forced_custom_call_is_the_whole_answer(tokenizers):
    from mlxd.engine.chat.freeform import FreeformOutput

    tok = tokenizers("hermes_think")
    for chunks in every_cut("hm</think>*** Begin"):
        out = run(FreeformOutput(OutputSplitter(tok, initial="reasoning"), "apply_patch"), chunks)
        assert out.reasoning == "hm" and out.text == ""
        (call,) = out.tool_calls
        assert (call.name, call.input) == ("apply_patch", "*** Begin")
        assert json.loads(call.arguments) == {"input": "*** Begin"}


def test_a_call_repeated_verbatim_is_sent_once(tokenizers):
    """Issue 33 item 3: the demo model under tool_choice "required" repeated its call."""
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    same = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}\n'
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n'
    text = f"{one}</tool_call>\n{same}</tool_call>\n{other}</tool_call>"
    for chunks in every_cut(text)[:40]:
        out = run(OutputSplitter(tokenizers("hermes"), parse_tools=True), chunks)
        assert calls(out) == [
            (0, "get_weather", {"city": "Paris", "unit": "c"}),
            (1, "get_weather", {"city": "Rome", "unit": "c"}),
        ], chunks
