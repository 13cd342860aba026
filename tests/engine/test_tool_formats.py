"""Enforced tool calls in every tool-call format: what the grammar allows, the model's parser reads.

For each format, the grammar of a forced call is compiled on a real tiny
tokenizer and walked with random allowed tokens (any output a model could
produce under it), then split by mlxd's splitter with that format's own
parser: every walk must give valid calls to the declared tools, with nothing
left as text. No model weights run.
"""

from __future__ import annotations

import importlib
import itertools
import json
import types
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.chat.grammar import Grammars, make_ll_tokenizer
from mlxd.engine.chat.harmony import HarmonySplitter
from mlxd.engine.chat.output import OutputSplitter, Split
from mlxd.engine.constraints import TOOL_GRAMMAR_FORMATS, StructureError, tool_constraint
from mlxd.engine.messages import ToolCall, ToolCallPart
from tests.support.tinymodels import tiny_model_dir
from tests.support.tool_templates import CALLS

WIDTH = 544
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "fast": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 2},
    },
    "required": ["city", "days", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a"],
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"name": n, "parameters": s, "strict": False} for n, s in SCHEMAS.items()]
TEMPLATE_TOOLS = tuple(
    {"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(Path(tiny_model_dir("llama", template="hermes")))


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(make_ll_tokenizer(tok, WIDTH), WIDTH)


def format_tokenizer(fmt: str) -> Any:
    """The parts of a tokenizer wrapper the splitter reads, for ``fmt``'s parser."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{fmt}")
    return types.SimpleNamespace(
        has_tool_calling=True,
        has_thinking=False,
        tool_call_start=module.tool_call_start,
        tool_call_end=module.tool_call_end,
        tool_parser=module.parse_tool_call,
    )


def walk(grammars: Grammars, tok: Any, constraint: Any, seed: int, steps: int = 4000) -> list[str]:
    """A random output the grammar allows, ended as soon as it may end (half the time),
    as the text each token added."""
    rng = np.random.default_rng(seed)
    matcher = grammars.matcher(constraint)
    eos = set(tok.eos_token_ids)
    out: list[int] = []
    for _ in range(steps):
        mask = matcher.compute_bitmask()
        assert not matcher.is_error(), matcher.get_error()
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:WIDTH]
        allowed = [int(t) for t in np.flatnonzero(bits)]
        text_tokens = [t for t in allowed if t not in eos]
        if not text_tokens or (len(text_tokens) < len(allowed) and rng.random() < 0.5):
            texts = [tok.decode(out[:n]) for n in range(len(out) + 1)]
            return [b[len(a) :] for a, b in itertools.pairwise(texts)]
        token = int(rng.choice(text_tokens))
        assert matcher.consume_token(token)
        out.append(token)
    pytest.fail(f"the walk did not end in {steps} tokens: {tok.decode(out)!r}")


PARSED_FORMATS = list(TOOL_GRAMMAR_FORMATS)


def splitter_for(fmt: str, tools: tuple[dict, ...]) -> OutputSplitter | HarmonySplitter:
    if fmt == "harmony":  # mlxd's own reader: mlx-lm has no Harmony parser
        return HarmonySplitter(parse_tools=True)
    return OutputSplitter(format_tokenizer(fmt), parse_tools=True, tools=tools, tool_format=fmt)


def split(fmt: str, pieces: list[str]) -> tuple[list[Split], OutputSplitter | HarmonySplitter]:
    """The pieces through a splitter with ``fmt``'s parser, one feed a token, as a row does."""
    splitter = splitter_for(fmt, TEMPLATE_TOOLS)
    return [*(splitter.feed(p) for p in pieces), splitter.finish()], splitter


def check_streamed(splits: list[Split], calls: list[ToolCall]) -> None:
    """The first call was opened before it ended; each streamed call's parts join to its
    arguments (a section's later calls may come whole)."""
    parts: dict[int, list[ToolCallPart]] = {}
    for n, s in enumerate(splits):
        for part in s.tool_parts:
            parts.setdefault(part.index, []).append(part)
        for call in s.tool_calls:
            mine = parts.get(call.index, [])
            if call.index == 0:
                assert len(mine) >= 2 and mine[0].arguments == "" and n > 0
            if mine:
                assert {(p.id, p.name) for p in mine} == {(call.id, call.name)}
                assert "".join(p.arguments for p in mine) == call.arguments


@pytest.mark.parametrize("fmt", PARSED_FORMATS)
def test_every_output_a_format_allows_parses_to_valid_calls(fmt, tok, grammars):
    for parallel, seeds in ((False, range(2)), (True, range(1))):
        c = tool_constraint(TOOLS, tool_format=fmt, parallel=parallel, param="tool_choice")
        for seed in seeds:
            pieces = walk(grammars, tok, c, seed)
            text = "".join(pieces)
            splits, splitter = split(fmt, pieces)
            calls = [call for s in splits for call in s.tool_calls]
            assert calls and splitter.failed_calls == 0, text
            assert not "".join(s.text for s in splits).strip(), text
            if not parallel:
                assert len(calls) == 1, text
            assert [c.index for c in calls] == list(range(len(calls)))
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            check_streamed(splits, calls)


@pytest.mark.parametrize("fmt", PARSED_FORMATS)
def test_a_named_function_is_the_one_called(fmt, tok, grammars):
    c = tool_constraint(TOOLS[1:], tool_format=fmt, parallel=False, param="tool_choice")
    splits, _ = split(fmt, walk(grammars, tok, c, seed=7))
    assert [c.name for s in splits for c in s.tool_calls] == ["add"]


def test_what_a_format_cannot_carry_is_refused_by_name():
    nested = {
        "type": "object",
        "properties": {"items": {"type": "array"}},
        "required": ["items"],
    }
    tool = {"name": "f", "parameters": nested, "strict": False, "param": "tools[0].parameters"}
    with pytest.raises(StructureError, match="function_gemma") as err:
        tool_constraint([tool], tool_format="function_gemma", parallel=False, param="tool_choice")
    assert err.value.code == "tool_format_unsupported"
    assert err.value.param == "tools[0].parameters.properties.items"
    # Elsewhere an array is JSON, and an optional one is left out in function_gemma.
    tool_constraint([tool], tool_format="qwen3_coder", parallel=False, param="tool_choice")
    optional = {**tool, "parameters": {**nested, "required": []}}
    tool_constraint([optional], tool_format="function_gemma", parallel=False, param="p")

    patterned = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}
    strict = {"name": "f", "parameters": patterned, "strict": True}
    with pytest.raises(StructureError, match="pattern") as err:
        tool_constraint([strict], tool_format="glm47", parallel=False, param="tool_choice")
    assert err.value.code == "invalid_schema"
    tool_constraint([{**strict, "strict": False}], tool_format="glm47", parallel=False, param="p")
    tool_constraint([strict], tool_format="json_tools", parallel=False, param="p")  # JSON: enforced


LONG = "the quick brown fox jumps over the lazy dog again"
WRITE = {
    "type": "function",
    "function": {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
        },
    },
}


@pytest.mark.parametrize("fmt", PARSED_FORMATS)
def test_a_long_string_argument_streams_in_pieces(fmt):
    """A call written as the format's template writes it, fed a character at a time:
    its arguments arrive in pieces before it ends (a string as it grows, where the
    parser keeps strings raw) and join to the finished call's arguments."""
    import jinja2

    call = {"name": "write", "arguments": {"n": 3, "text": LONG}}
    text = jinja2.Environment().from_string(CALLS[fmt]).render(tc=call)
    splitter = splitter_for(fmt, (WRITE,))
    splits = [*(splitter.feed(c) for c in text), splitter.finish()]
    (final,) = [c for s in splits for c in s.tool_calls]
    assert json.loads(final.arguments) == call["arguments"]
    check_streamed(splits, [final])
    before_end = [p.arguments for s in splits[:-2] for p in s.tool_parts if p.arguments]
    grows = fmt not in ("muse_spark", "pythonic")  # their strings are JSON / Python literals
    assert len(before_end) >= (3 if grows else 2), before_end


def test_every_prefix_of_json_arguments_gives_a_prefix_of_their_final_text():
    from mlxd.engine.chat.tool_stream import json_prefix

    text = (
        '{"path": "a\\"b\\u00e9\\ud83d\\ude00 end\\\\u12", "n": 12, "f": 1.50,'
        ' "o": {"x": [1, 2]}, "t": true, "z": null}'
    )
    final = json.dumps(json.loads(text), ensure_ascii=False)
    prefixes = [json_prefix(text[:i], 0)[0] for i in range(len(text) + 1)]
    assert all(final.startswith(p) for p in prefixes)
    assert prefixes[-1] == final and len(set(prefixes)) > 20
