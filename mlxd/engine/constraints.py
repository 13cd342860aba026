"""Grammars for structured output and enforced tool calls, built here and checked off the loop.

Pure and MLX-free (the HTTP side uses it): JSON Schema becomes an llguidance
grammar with llguidance's own compiler, and a tool call is a small Lark
grammar in the model's native call format around ``%json`` schemas. Building
a :class:`~mlxd.engine.messages.Constraint` only wraps the schemas (cheap, on
the event loop); :func:`check_constraint` then measures them against
:mod:`mlxd.engine.schema_limits` and :func:`validate_constraint` has
llguidance validate the grammar without a tokenizer. Both block, so the HTTP
side runs them in a worker thread under a time budget, before the request is
queued: a bad schema is a 400 before anything is generated.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher, LLParserLimits

from mlxd.engine.messages import Constraint
from mlxd.engine.schema_limits import StructureError, check_schema
from mlxd.engine.tool_grammars import BUILDERS, tool_grammar

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stub's TypedDict (not at runtime)

__all__ = [
    "TOOL_GRAMMAR_FORMATS",
    "StructureError",
    "check_constraint",
    "json_constraint",
    "parser_limits",
    "tool_constraint",
    "validate_constraint",
]

# Tool-call formats (mlx-lm tool parser names, and gpt-oss's harmony) that have a grammar.
TOOL_GRAMMAR_FORMATS = tuple(BUILDERS)
MAX_PARALLEL_CALLS = 8
# llguidance's error messages quote the grammar and the parser state unless
# told not to; a client's 400 needs the reason only.
_MAX_MESSAGE = 600


def parser_limits() -> LLParserLimits:
    """llguidance's own limits as mlxd uses them: its defaults, with short errors."""
    return LLParserLimits(verbose_errors=False)


def _key(grammar: str) -> str:
    return hashlib.sha256(grammar.encode()).hexdigest()


def short(message: str) -> str:
    """An llguidance message cut to what a client needs."""
    message = message.replace("<non-verbose/>", "").strip()
    return message if len(message) <= _MAX_MESSAGE else message[:_MAX_MESSAGE] + " …"


def check_constraint(constraint: Constraint) -> None:
    """Measure the constraint's schemas against the limits (StructureError); blocking."""
    for param, schema in constraint.schemas:
        check_schema(schema, param=param)


def validate_constraint(constraint: Constraint, param: str) -> None:
    """Have llguidance validate the grammar without a tokenizer (StructureError); blocking.

    For when no model's tokenizer is at hand; with one, compiling the
    matcher validates the same way (``mlxd.engine.chat.grammar``).
    """
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        constraint.grammar, limits=parser_limits()
    )
    if is_error:
        why = short("; ".join(messages) or "invalid grammar")
        raise StructureError(
            f"The schema cannot be enforced: {why}. "
            "With strict, every keyword must be enforceable; without strict, "
            "unsupported keywords are ignored.",
            code="invalid_schema",
            param=param,
        )


# A number in a constrained answer: at most 15 digits before the point and 6
# after, no exponent, unless the schema bounds it itself. An unbounded
# "integer" let a small model write digits until max_tokens (issue 33).
NUMBER_BOUND = 10**15 - 1
NUMBER_STEP = 1e-6
# Values that are data, not subschemas: never rewritten.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with a digit cap on every number it leaves unbounded (a copy; pure).

    An ``integer`` or ``number`` subschema without ``minimum`` (``exclusiveMinimum``)
    gets ``minimum: -NUMBER_BOUND``, likewise ``maximum``; a ``number`` without
    ``multipleOf`` gets ``multipleOf: NUMBER_STEP``. Bounds the schema sets stay.
    """
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else bounded_numbers(v)) for k, v in schema.items()}
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & {"integer", "number"} and all(isinstance(k, str) for k in kinds):
        low = _bound(schema, "minimum", "exclusiveMinimum")
        high = _bound(schema, "maximum", "exclusiveMaximum")
        if low is None:
            out["minimum"] = (
                -NUMBER_BOUND if high is None else min(-NUMBER_BOUND, high - NUMBER_BOUND)
            )
        if high is None:
            out["maximum"] = NUMBER_BOUND if low is None else max(NUMBER_BOUND, low + NUMBER_BOUND)
        if "number" in kinds and "multipleOf" not in schema:
            out["multipleOf"] = NUMBER_STEP
    return out


def _bound(schema: dict[str, Any], *keys: str) -> float | None:
    """The schema's own bound among ``keys`` (a draft-4 boolean ``exclusive*`` is none)."""
    for key in keys:
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def _schema_options(strict: bool) -> JsonCompileOptions:
    # Compact JSON (no free whitespace a random or small model could loop in).
    return {"whitespace_flexible": False, "lenient": not strict}


def json_constraint(schema: Any, *, strict: bool, param: str) -> Constraint:
    """The constraint for a ``json_schema`` (or ``json_object``) response format."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise StructureError(
            "The schema is not valid: a schema is an object (or true); "
            "false would allow no answer at all.",
            code="invalid_schema",
            param=param,
        )
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            bounded_numbers(schema), defaults=_schema_options(strict)
        )
    except (ValueError, TypeError) as exc:
        raise StructureError(
            f"The schema is not valid: {short(str(exc))}", code="invalid_schema", param=param
        ) from None
    return Constraint("json", grammar, _key(grammar), schemas=((param, schema),))


def _json_rule(schema: dict[str, Any], strict: bool) -> str:
    with_options = {**bounded_numbers(schema), "x-guidance": _schema_options(strict)}
    return "%json " + json.dumps(with_options, ensure_ascii=False)


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

    ``tools`` are ``{"name", "parameters", "strict"}``, with ``"param"``, the
    name a refusal of its parameters gives (default ``param``); pass only the
    named function for a named ``tool_choice``.
    """
    if tool_format is None or tool_format not in TOOL_GRAMMAR_FORMATS:
        raise StructureError(
            f"tool_choice 'required' or a named function is enforced with a grammar in the "
            f"model's tool-call format, and the '{tool_format}' format has none yet "
            f"(formats with one: {', '.join(TOOL_GRAMMAR_FORMATS)}). Use tool_choice 'auto'.",
            code="tool_format_unsupported",
            param=param,
        )
    most = MAX_PARALLEL_CALLS if parallel else 1
    tools = [{**t, "parameters": _closed(t["parameters"])} for t in tools]
    lark = tool_grammar(tool_format, tools, most, _json_rule)
    grammar = LLMatcher.grammar_from_lark(lark)
    schemas = tuple((t.get("param", param), t["parameters"]) for t in tools)
    return Constraint("tools", grammar, _key(grammar), tool_format=tool_format, schemas=schemas)
