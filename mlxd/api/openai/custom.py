"""OpenAI ``custom`` tools in request bodies: their definitions, a named choice, history calls.

A custom tool takes one string instead of JSON arguments, optionally in a
grammar (Codex's ``apply_patch`` is one, in Lark). Chat completions nest it
(``{"type": "custom", "custom": {name, description, format}}``), the
Responses API does not (``{"type": "custom", name, description, format}``);
both come here. The model sees it as a function taking one string
(:func:`mlxd.engine.template_tool`); the grammars are the engine's
(:mod:`mlxd.engine.custom_tools`). docs/tools.md says how calls are made.
"""

from __future__ import annotations

import re
from typing import Any

from mlxd.api.http.errors import OpenAIError
from mlxd.api.params import bad
from mlxd.engine import CustomTool, StructureError, custom_grammar, template_tool

# The one parameter the model sees a custom tool take (engine.custom_tools.INPUT).
INPUT = "input"
# A tool's name, function or custom (OpenAI's rule).
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def valid_name(name: Any, param: str) -> str:
    """``name`` when it is a valid tool name; else a 400 naming ``param``."""
    if not isinstance(name, str) or not NAME.match(name):
        raise bad(param, f"{param} must be 1-64 letters, digits, '_', '.' or '-' (got {name!r}).")
    return name


def _format(fmt: Any, param: str) -> tuple[str | None, Any]:
    """``(syntax, definition)`` of a custom tool's format; ``(None, None)`` for text."""
    if fmt is None:
        return None, None
    if not isinstance(fmt, dict):
        raise bad(param, f"{param} must be an object.")
    kind = fmt.get("type")
    if kind == "text":
        return None, None
    if kind != "grammar":
        raise bad(f"{param}.type", f"{param}.type must be 'text' or 'grammar', not {kind!r}.")
    # Chat completions nest the grammar ({"grammar": {syntax, definition}}); Responses do not.
    nested = fmt.get("grammar")
    spec: dict[str, Any] = nested if isinstance(nested, dict) else fmt
    if spec.get("syntax") is None and spec.get("definition") is None:
        return None, None  # a grammar format with no grammar constrains nothing
    syntax = spec.get("syntax")
    if not isinstance(syntax, str):
        raise bad(f"{param}.syntax", f"{param} needs 'syntax': 'lark' or 'regex'.")
    return syntax, spec.get("definition")


def custom_tool(body: dict[str, Any], param: str) -> tuple[dict[str, Any], CustomTool]:
    """A custom tool's definition (``{name, description, parameters, strict}``, the shape
    the chat path's function tools take) and its engine value; 400 when it is malformed."""
    extra = set(body) - {"name", "description", "format"}
    if extra:
        raise bad(param, f"Unrecognized field(s) in {param}: {', '.join(sorted(extra))}.")
    name = valid_name(body.get("name"), f"{param}.name")
    description = body.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{param}.description", "A tool's description must be a string.")
    syntax, definition = _format(body.get("format"), f"{param}.format")
    try:
        grammar = custom_grammar(syntax, definition, param=f"{param}.format")
    except StructureError as exc:
        raise OpenAIError(400, str(exc), code=exc.code, param=exc.param) from None
    out = {**template_tool(name, description)["function"], "strict": False}
    return out, CustomTool(name, grammar)


def chosen_name(choice: dict[str, Any]) -> Any:
    """The name a ``{"type": "custom", ...}`` tool_choice gives (either API's shape)."""
    inner = choice.get("custom")
    return inner.get("name") if isinstance(inner, dict) else choice.get("name")


def history_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    """A chat-history ``{"type": "custom", "custom": {name, input}}`` call in the
    template's shape: a function call whose one argument is the input."""
    inner = call.get("custom")
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
        raise bad(param, f"{param} must be {{'id', 'type': 'custom', 'custom': {{name, input}}}}.")
    text = inner.get("input", "")
    if not isinstance(text, str):
        raise bad(f"{param}.custom.input", f"{param}'s input must be a string.")
    return {"name": inner["name"], "arguments": {INPUT: text}}


def call_json(name: str, text: str) -> dict[str, Any]:
    """A custom call as chat completions render it (``custom: {name, input}``)."""
    return {"type": "custom", "custom": {"name": name, "input": text}}
