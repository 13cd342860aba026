"""The Lark pieces every tool-call format's grammar is built from (no MLX).

A :class:`Builder` names rules and writes the two shapes the formats share:
items in order where optional ones may be absent (a call's parameters) and
one to ``most`` repeats (parallel calls). :func:`value` writes one
property's value as a format's parser reads it back: raw text for a string
(one lexeme up to and including its closing tag, never starting or ending
with blanks, which the parsers strip), compact JSON for anything else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlxd.engine.schema_limits import StructureError

__all__ = [
    "Builder",
    "JsonRule",
    "Tool",
    "json_args",
    "kind_of",
    "lit",
    "params",
    "properties",
    "value",
]

# One tool as the constraint builder hands it over: {"name", "parameters", "strict", ...}.
Tool = dict[str, Any]
JsonRule = Callable[[dict[str, Any], bool], str]

_TYPED = {"integer", "number", "boolean", "object", "array", "null"}
# Formats whose parser reads an untyped property's value as text unless it is an object/array.
_UNTYPED_AS_TEXT = {"qwen3_coder", "minimax_m2", "minicpm5"}


def lit(text: str) -> str:
    return json.dumps(text)


def hex_escaped(text: str) -> str:
    # Inside a Lark /regex/ llguidance reads Rust regex syntax, where "\<" is a
    # word boundary: every punctuation character is written as a hex escape.
    return "".join(c if c.isalnum() or c == "_" else f"\\x{ord(c):02X}" for c in text)


class Builder:
    """Rules of one grammar: a fresh name for each, then the text."""

    def __init__(self, fmt: str, json_rule: JsonRule):
        self.fmt = fmt
        self.json_rule = json_rule
        self.rules: list[str] = []
        self._n = 0

    def rule(self, body: str) -> str:
        self._n += 1
        name = f"r{self._n}"
        self.rules.append(f"{name}: {body}")
        return name

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules]) + "\n"

    def sequence(self, items: list[tuple[str, bool]], sep: str) -> str:
        """Items in order, optional ones (``required`` False) may be absent, ``sep`` between."""
        if not items:
            return '""'
        first, after = '""', '""'
        for expr, required in reversed(items):
            with_sep = f"{lit(sep)} {expr} {after}" if sep else f"{expr} {after}"
            new_after = self.rule(with_sep if required else f"{with_sep} | {after}")
            new_first = self.rule(f"{expr} {after}" if required else f"{expr} {after} | {first}")
            first, after = new_first, new_after
        return first

    def repeat(self, call: Callable[[int], str], most: int, sep: str = "") -> str:
        """One to ``most`` calls, ``call(k)`` the k-th (0-based), ``sep`` between."""
        tail = '""'
        for k in reversed(range(1, most)):
            tail = self.rule(
                f"{lit(sep)} {call(k)} {tail} | {lit('')}"
                if sep
                else f"{call(k)} {tail} | {lit('')}"
            )
        return f"{call(0)} {tail}"

    def any_tool(self, tools: list[Tool], one: Callable[[Tool, int], str]) -> str:
        return self.rule(" | ".join(one(t, i) for i, t in enumerate(tools)))


def properties(tool: Tool) -> list[tuple[str, dict[str, Any], bool]]:
    params = tool["parameters"]
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    shared = {k: params[k] for k in ("$defs", "definitions") if k in params}
    return [
        (key, {**shared, **schema} if isinstance(schema, dict) else schema, key in required)
        for key, schema in props.items()
    ]


def string_values(schema: Any) -> list[str] | None:
    """The values of a string-only enum/const, else None."""
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None


def kind_of(schema: Any) -> str:
    """``text`` (written raw), ``json`` (a typed value) or ``untyped``."""
    if not isinstance(schema, dict):
        return "untyped"
    kind = schema.get("type")
    if kind == "string" or (kind is None and string_values(schema) is not None):
        return "text"
    if isinstance(kind, str) and kind in _TYPED:
        return "json"
    return "untyped"


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _raw_text(
    b: Builder, schema: dict[str, Any], strict: bool, forbid: str, end: str, param: str
) -> str:
    """A string value written raw, up to and including the ``end`` tag (one lexeme)."""
    if (values := string_values(schema)) is not None:
        return f"({' | '.join(lit(v) for v in values)}) {lit(end)}"
    if strict and (schema.get("pattern") is not None or schema.get("format") is not None):
        raise StructureError(
            f"The '{b.fmt}' format writes strings raw, so 'pattern' and 'format' "
            "cannot be enforced in it; drop strict or the keyword.",
            code="invalid_schema",
            param=param,
        )
    inner = "".join(f"\\x{ord(c):02X}" for c in forbid)
    edge, mid = f"[^{inner}\\s]", f"[^{inner}]"
    low, high = _count(schema.get("minLength")) or 0, _count(schema.get("maxLength"))
    if low == 0 and high is None:
        body = f"(?:{edge}(?:{mid}*{edge})?)?"
    else:
        alts = [""] if low == 0 else []
        if low <= 1 and (high is None or high >= 1):
            alts.append(edge)
        if high is None or high >= 2:
            top = "" if high is None else str(high - 2)
            alts.append(f"{edge}{mid}{{{max(0, low - 2)},{top}}}{edge}")
        body = "(?:" + "|".join(alts) + ")"
    return f"/{body}{hex_escaped(end)}/"


def value(b: Builder, tool: Tool, key: str, schema: Any, end: str, forbid: str = "<") -> str:
    """One property's value followed by ``end``, as the format's parser reads it back."""
    param = f"{tool.get('param', 'tools')}.properties.{key}"
    kind = kind_of(schema)
    if kind == "text":
        return _raw_text(b, schema, tool["strict"], forbid, end, param)
    if kind == "untyped" and b.fmt in _UNTYPED_AS_TEXT and tool["strict"]:
        raise StructureError(
            f"The '{b.fmt}' format's parser reads a property without a 'type' as text, so "
            f"'{key}' cannot be enforced as a non-string value; give it a 'type'.",
            code="invalid_schema",
            param=param,
        )
    rule = b.json_rule(schema if isinstance(schema, dict) else {}, tool["strict"])
    return f"{rule} {lit(end)}" if end else rule


def params(
    b: Builder, tool: Tool, head: Callable[[str], str], end: str, sep: str = "", forbid: str = "<"
) -> str:
    """Each property as ``head(key)`` then its value closed by ``end``; ``sep`` between."""
    items = [
        (f"{lit(head(k))} {value(b, tool, k, s, end, forbid)}", req)
        for k, s, req in properties(tool)
    ]
    return b.sequence(items, sep)


def json_args(b: Builder, tool: Tool) -> str:
    return b.json_rule(tool["parameters"], tool["strict"])
