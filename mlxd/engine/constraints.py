"""Grammars for structured output and enforced tool calls, built and checked up front.

Pure and MLX-free (the HTTP side uses it before queueing a request): JSON
Schema becomes an llguidance grammar with llguidance's own compiler, and a
tool call is a small Lark grammar in the model's native call format around
``%json`` schemas. Checking here means a bad schema is a 400 before the
request is queued; the engine compiles the same grammar for the model.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher

from mlxd.engine.messages import Constraint, ErrorCode

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stub's TypedDict (not at runtime)

# The JSON compiler's options: compact JSON (no free whitespace a random or
# small model could loop in). ``lenient`` is set per schema (strict -> False).

# Tool-call formats (mlx-lm tool parser names) that have a grammar.
TOOL_GRAMMAR_FORMATS = ("json_tools", "mistral")
MAX_PARALLEL_CALLS = 8


class StructureError(ValueError):
    """A schema or tool definition that cannot be enforced; a 400."""

    def __init__(self, message: str, *, code: ErrorCode, param: str):
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param


def _key(grammar: str) -> str:
    return hashlib.sha256(grammar.encode()).hexdigest()


def _check(grammar: str, param: str) -> None:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        why = "; ".join(messages) or "invalid grammar"
        raise StructureError(
            f"The schema cannot be enforced: {why}. "
            "With strict, every keyword must be enforceable; without strict, "
            "unsupported keywords are ignored.",
            code="invalid_schema",
            param=param,
        )


def _schema_options(strict: bool) -> JsonCompileOptions:
    return {"whitespace_flexible": False, "lenient": not strict}


def json_constraint(schema: dict[str, Any], *, strict: bool, param: str) -> Constraint:
    """The constraint for a ``json_schema`` (or ``json_object``) response format."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_schema_options(strict))
    except (ValueError, TypeError) as exc:
        raise StructureError(
            f"The schema is not valid: {exc}", code="invalid_schema", param=param
        ) from None
    _check(grammar, param)
    return Constraint("json", grammar, _key(grammar))


def _json_rule(schema: dict[str, Any], strict: bool) -> str:
    with_options = {**schema, "x-guidance": _schema_options(strict)}
    return "%json " + json.dumps(with_options, ensure_ascii=False)


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _hermes(tools: list[dict[str, Any]], most: int) -> str:
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": t["parameters"],
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    strict = all(t["strict"] for t in tools)
    body = _json_rule({"anyOf": options}, strict)
    more = f' ("\\n" call){{0,{most - 1}}}' if most > 1 else ""
    return f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: {body}\n'


def _mistral(tools: list[dict[str, Any]], most: int) -> str:
    alts = " | ".join(f"fn{i}" for i in range(len(tools)))
    rules = "\n".join(
        f"fn{i}: {_lark_string(t['name'] + '[ARGS]')} {_json_rule(t['parameters'], t['strict'])}"
        for i, t in enumerate(tools)
    )
    repeat = f"{{1,{most}}}" if most > 1 else ""
    return f'start: "[TOOL_CALLS]" call{repeat}\ncall: {alts}\n{rules}\n'


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    # An enforced call takes only the declared arguments (OpenAI's strict
    # mode requires this too); a schema that says otherwise keeps its say.
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def tool_constraint(
    tools: list[dict[str, Any]], *, tool_format: str | None, parallel: bool, param: str
) -> Constraint:
    """The grammar that forces one call (or up to 8 with ``parallel``) to one of ``tools``.

    ``tools`` are ``{"name", "parameters", "strict"}``; pass only the named
    function for a named ``tool_choice``.
    """
    if tool_format not in TOOL_GRAMMAR_FORMATS:
        raise StructureError(
            f"tool_choice 'required' or a named function is enforced with a grammar in the "
            f"model's tool-call format, and the '{tool_format}' format has none yet "
            f"(formats with one: {', '.join(TOOL_GRAMMAR_FORMATS)}). Use tool_choice 'auto'.",
            code="tool_format_unsupported",
            param=param,
        )
    most = MAX_PARALLEL_CALLS if parallel else 1
    tools = [{**t, "parameters": _closed(t["parameters"])} for t in tools]
    lark = _hermes(tools, most) if tool_format == "json_tools" else _mistral(tools, most)
    grammar = LLMatcher.grammar_from_lark(lark)
    _check(grammar, param)
    return Constraint("tools", grammar, _key(grammar), tool_format=tool_format)
