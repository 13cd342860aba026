"""An enforced tool call's grammar in each model's own call format (llguidance Lark, no MLX).

Every format mlx-lm has a parser for gets one, written so that what the
grammar allows is what that parser reads back as the named function with
arguments that satisfy its schema. JSON-bodied formats (``json_tools``,
``mistral``, ``kimi_k2``, ``kimi_k3``, ``harmony``) embed the parameters'
schema whole (``%json``). Formats that write one parameter at a time
(``qwen3_coder``, ``glm47``, ``minimax_m2``, ``gemma4``, ...) embed each
property: a string property is written raw, as the model's template writes
it (a terminal that cannot hold the closing tag nor start or end with
blanks, which the parsers strip), anything else as compact JSON, which each
of those parsers decodes. Properties keep their declared order; optional ones
may be left out.

What a format cannot carry is refused before anything runs
(:class:`StructureError`): a required object or array in ``function_gemma``
(its parser stops at the first ``}`` and ``,``), and, with ``strict``, a
string ``pattern``/``format`` written raw, or an untyped non-string property
in the formats whose parser reads untyped values as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlxd.engine.schema_limits import StructureError
from mlxd.engine.tool_grammar_parts import (
    Builder,
    JsonRule,
    Tool,
    json_args,
    kind_of,
    lit,
    params,
    properties,
    value,
)

__all__ = ["BUILDERS", "tool_grammar"]


# ---------------------------------------------------------------- the formats


def _json_tools(b: Builder, tools: list[Tool], most: int) -> str:
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, "arguments": _own_resource(t, i)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    body = b.json_rule({"anyOf": options}, all(t["strict"] for t in tools))
    call = b.rule(f'"<tool_call>\\n" {body} "\\n</tool_call>"')
    calls = b.repeat(lambda _: call, most, "\n")
    # After a call, "\n" may open the next one or end the answer, and a second
    # "\n" (what a model that wants to go on in prose writes) ends it: a "\n" that
    # could only open another call made a small model repeat its call (issue 33).
    return f'{calls} ("\\n" "\\n"?)?' if most > 1 else calls


def _own_resource(tool: Tool, i: int) -> dict[str, Any]:
    # Nested in the call object, a tool's "#/$defs/..." would resolve against
    # the call object; an $id makes its parameters the root of their own refs.
    parameters = tool["parameters"]
    if "$id" in parameters:
        return parameters
    return {"$id": f"urn:mlxd:tool:{i}", **parameters}


def _mistral(b: Builder, tools: list[Tool], most: int) -> str:
    call = b.any_tool(tools, lambda t, _: f"{lit(t['name'] + '[ARGS]')} {json_args(b, t)}")
    return f'"[TOOL_CALLS]" {b.repeat(lambda _: call, most)}'


def _qwen3_coder(b: Builder, tools: list[Tool], most: int) -> str:
    def one(t: Tool, _: int) -> str:
        written = params(b, t, lambda k: f"<parameter={k}>\n", "\n</parameter>\n")
        head = lit("<function=" + t["name"] + ">\n")
        return f'{head} {written} "</function>"'

    fn = b.any_tool(tools, one)
    call = b.rule(f'"<tool_call>\\n" {fn} "\\n</tool_call>"')
    return b.repeat(lambda _: call, most, "\n")


def _glm47(b: Builder, tools: list[Tool], most: int) -> str:
    def one(t: Tool, _: int) -> str:
        written = params(b, t, lambda k: f"<arg_key>{k}</arg_key><arg_value>", "</arg_value>")
        return f"{lit(t['name'])} {written}"

    call = b.rule(f'"<tool_call>" {b.any_tool(tools, one)} "</tool_call>"')
    return b.repeat(lambda _: call, most)


def _longcat(b: Builder, tools: list[Tool], most: int) -> str:
    def one(t: Tool, _: int) -> str:
        if not properties(t):  # its parser needs an argument key, or JSON
            return lit(json.dumps({"name": t["name"], "arguments": {}}))
        written = params(
            b,
            t,
            lambda k: f"<longcat_arg_key>{k}</longcat_arg_key><longcat_arg_value>",
            "</longcat_arg_value>",
        )
        return f"{lit(t['name'])} {written}"

    call = b.rule(f'"<longcat_tool_call>" {b.any_tool(tools, one)} "</longcat_tool_call>"')
    return b.repeat(lambda _: call, most)


def _minimax_m2(b: Builder, tools: list[Tool], most: int) -> str:
    def one(t: Tool, _: int) -> str:
        written = params(b, t, lambda k: f'<parameter name="{k}">', "</parameter>\n")
        head = lit('<invoke name="' + t["name"] + '">\n')
        return f'{head} {written} "</invoke>\\n"'

    invoke = b.any_tool(tools, one)
    calls = b.repeat(lambda _: invoke, most)
    return f'"<minimax:tool_call>\\n" {calls} "</minimax:tool_call>"'


def _minicpm5(b: Builder, tools: list[Tool], most: int) -> str:
    def one(t: Tool, _: int) -> str:
        written = params(b, t, lambda k: f'<param name="{k}">', "</param>", forbid="<&")
        head = lit('<function name="' + t["name"] + '">')
        return f'{head} {written} "</function>"'

    call = b.any_tool(tools, one)
    return b.repeat(lambda _: call, most)


def _muse_spark(b: Builder, tools: list[Tool], most: int) -> str:
    def one(t: Tool, _: int) -> str:
        items = [
            (
                lit('<atem:parameter name="' + k + '">')
                + " "
                + f"{b.json_rule(s if isinstance(s, dict) else {}, t['strict'])} "
                '"</atem:parameter>"',
                req,
            )
            for k, s, req in properties(t)
        ]
        head = lit(f'<atem:invoke name="{t["name"]}">')
        return f'{head} {b.sequence(items, "")} "</atem:invoke>"'

    invoke = b.any_tool(tools, one)
    calls = b.repeat(lambda _: invoke, most)
    return f'"<atem:function_calls>" {calls} "</atem:function_calls>"'


def _kimi_k2(b: Builder, tools: list[Tool], most: int) -> str:
    # The call's number (its id's tail) is any digit: one rule per tool, not one per call.
    call = b.any_tool(
        tools,
        lambda t, _: (
            lit(f"<|tool_call_begin|>functions.{t['name']}:")
            + ' /[0-9]/ "<|tool_call_argument_begin|>" '
            + f'{json_args(b, t)} "<|tool_call_end|>"'
        ),
    )
    calls = b.repeat(lambda _: call, most)
    return f'"<|tool_calls_section_begin|>" {calls} "<|tool_calls_section_end|>"'


def _kimi_k3(b: Builder, tools: list[Tool], most: int) -> str:
    call = b.any_tool(
        tools,
        lambda t, _: (
            lit(f'<|open|>call tool="{t["name"]}" index="')
            + ' /[1-9]/ "\\"<|sep|><|open|>json type=\\"object\\"<|sep|>" '
            + f'{json_args(b, t)} "<|close|>json<|sep|><|close|>call<|sep|>"'
        ),
    )
    return f'"<|open|>tools<|sep|>" {b.repeat(lambda _: call, most)} "<|close|>tools<|sep|>"'


def _gemma(b: Builder, tools: list[Tool], most: int, quote: str, start: str, end: str) -> str:
    def one(t: Tool, _: int) -> str:
        items = []
        for k, s, req in properties(t):
            kind = kind_of(s)
            nested = not isinstance(s, dict) or s.get("type") in ("object", "array")
            if kind == "text":
                text = f"{lit(quote)} {value(b, t, k, s, quote, forbid='<}')}"
            elif start == "<start_function_call>" and (kind == "untyped" or nested):
                # Its parser ends the arguments at the first "}" and a value at ",".
                if not req:
                    continue
                raise StructureError(
                    f"The 'function_gemma' format cannot carry '{k}' (an object, array or "
                    "untyped value); make it a string or a scalar.",
                    code="tool_format_unsupported",
                    param=f"{t.get('param', 'tools')}.properties.{k}",
                )
            else:
                text = b.json_rule(s if isinstance(s, dict) else {}, t["strict"])
            items.append((f"{lit(k + ':')} {text}", req))
        head = lit("call:" + t["name"] + "{")
        return f'{head} {b.sequence(items, ",")} "}}"'

    call = b.rule(f"{lit(start)} {b.any_tool(tools, one)} {lit(end)}")
    return b.repeat(lambda _: call, most)


def _gemma4(b: Builder, tools: list[Tool], most: int) -> str:
    return _gemma(b, tools, most, '<|"|>', "<|tool_call>", "<tool_call|>")


def _function_gemma(b: Builder, tools: list[Tool], most: int) -> str:
    return _gemma(b, tools, most, "<escape>", "<start_function_call>", "<end_function_call>")


def _pythonic(b: Builder, tools: list[Tool], most: int) -> str:
    def one(t: Tool, _: int) -> str:
        items = [
            (f"{lit(k + '=')} {b.json_rule(s if isinstance(s, dict) else {}, t['strict'])}", req)
            for k, s, req in properties(t)
        ]
        return f'{lit(t["name"] + "(")} {b.sequence(items, ", ")} ")"'

    call = b.any_tool(tools, one)
    return f'"<|tool_call_start|>[" {b.repeat(lambda _: call, most, ", ")} "]<|tool_call_end|>"'


def _harmony(b: Builder, tools: list[Tool], most: int) -> str:
    # gpt-oss calls one function per message; the row ends at <|call|>.
    return b.any_tool(
        tools,
        lambda t, _: (
            lit(f"<|channel|>commentary to=functions.{t['name']} <|constrain|>json<|message|>")
            + f' {json_args(b, t)} "<|call|>"'
        ),
    )


BUILDERS: dict[str, Callable[[Builder, list[Tool], int], str]] = {
    "json_tools": _json_tools,
    "mistral": _mistral,
    "qwen3_coder": _qwen3_coder,
    "glm47": _glm47,
    "laguna": _glm47,
    "longcat": _longcat,
    "minimax_m2": _minimax_m2,
    "minicpm5": _minicpm5,
    "muse_spark": _muse_spark,
    "kimi_k2": _kimi_k2,
    "kimi_k3": _kimi_k3,
    "gemma4": _gemma4,
    "function_gemma": _function_gemma,
    "pythonic": _pythonic,
    "harmony": _harmony,
}


def tool_grammar(fmt: str, tools: list[Tool], most: int, json_rule: JsonRule) -> str:
    """The Lark grammar allowing 1 to ``most`` calls to ``tools`` in format ``fmt``."""
    b = Builder(fmt, json_rule)
    start = BUILDERS[fmt](b, tools, most)
    return b.text(start)
