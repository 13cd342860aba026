"""Tools, tool choice, structured output and template kwargs in OpenAI bodies.

Everything a request says about tools or output structure is checked here,
before the request is queued: malformed tools, an unknown named tool, tools
for a model without a tool parser, a schema that cannot be enforced. The
grammars themselves come from :mod:`mlxd.engine.constraints` (llguidance).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from mlxd.api.http.errors import OpenAIError
from mlxd.api.openai import custom
from mlxd.api.params import bad, relabel
from mlxd.engine import (
    Constraint,
    CustomTool,
    ModelInfo,
    StructureError,
    custom_constraint,
    json_constraint,
    tool_constraint,
)

MAX_TOOLS = 128
_NAME = custom.NAME
# Names a client may not set through chat_template_kwargs: the server's own
# template inputs and every parameter of Hugging Face's apply_chat_template
# (a client must not swap the template or change what comes back).
_RESERVED = {
    "messages",
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tool fields come to."""

    tools: tuple[dict, ...] = ()  # Hugging Face template shape, for the chat template
    parse: bool = False
    constraint: Constraint | None = None
    ignored: int = 0  # tools left out: the model cannot call tools and none was forced
    custom: tuple[CustomTool, ...] = ()  # the custom tools among ``tools``


def _tool(raw: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if isinstance(raw, dict) and raw.get("type") == "custom":
        if not isinstance(raw.get("custom"), dict) or set(raw) != {"type", "custom"}:
            raise bad(param, f"{param} must be {{'type': 'custom', 'custom': {{...}}}}.")
        made, tool = custom.custom_tool(raw["custom"], f"{param}.custom")
        return {**made, "custom": tool}
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise bad(f"{param}.type", f"{param} must be {{'type': 'function', 'function': {{...}}}}.")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{param}.function", f"{param} has no 'function' object.")
    extra = set(raw) - {"type", "function"}
    if extra:
        raise bad(param, f"Unrecognized field(s) in {param}: {', '.join(sorted(extra))}.")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad(
            f"{param}.function.name",
            f"{param}.function.name must be 1-64 letters, digits, '_', '.' or '-' (got {name!r}).",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{param}.function.description", "A tool's description must be a string.")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad(
            f"{param}.function.parameters",
            f"{param}.function.parameters must be a JSON Schema object with type 'object'.",
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{param}.function.strict", "'strict' must be a boolean.")
    extra = set(fn) - {"name", "description", "parameters", "strict"}
    if extra:
        raise bad(
            f"{param}.function",
            f"Unrecognized field(s) in {param}.function: {', '.join(sorted(extra))}.",
        )
    out: dict[str, Any] = {"name": name, "parameters": parameters, "strict": bool(strict)}
    if description is not None:
        out["description"] = description
    return out


def _choice(choice: Any, names: list[str]) -> str:
    """``none``/``auto``/``required``, or the named function (returned as ``fn:NAME``)."""
    if choice is None:
        return "auto" if names else "none"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") == "custom":
            name = custom.chosen_name(choice)
        if not isinstance(name, str):
            raise bad("tool_choice", "A named tool_choice needs function.name.")
        if name not in names:
            known = ", ".join(names) or "none"
            raise bad(
                "tool_choice",
                f"tool_choice names the function {name!r}, which is not in 'tools' ({known}).",
            )
        return f"fn:{name}"
    raise bad(
        "tool_choice",
        "tool_choice must be 'none', 'auto', 'required', "
        "{'type': 'function', 'function': {'name': ...}} or "
        "{'type': 'custom', 'custom': {'name': ...}}.",
    )


def tool_plan(
    tools: list[Any] | None, choice: Any, parallel: bool | None, info: ModelInfo | None
) -> ToolPlan:
    """Check the tool fields; build the grammar when the choice forces a call."""
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list.")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise bad("tools", f"At most {MAX_TOOLS} tools are allowed (as OpenAI), got {len(tools)}.")
    defs = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [d["name"] for d in defs]
    if len(set(names)) != len(names):
        raise bad("tools", "Two tools have the same name.")
    mode = _choice(choice, names)
    if mode == "none" or not defs:
        if mode not in ("none", "auto"):
            raise bad("tool_choice", f"tool_choice {choice!r} needs 'tools'.")
        return ToolPlan()
    tool_format = info.tool_format if info is not None else None
    if info is not None and tool_format is None:
        if mode == "auto":
            # Clients send their tools to every model (Open WebUI its built-in
            # ones, agents theirs): the model may answer without them, so it does.
            return ToolPlan(ignored=len(defs))
        raise OpenAIError(
            400,
            f"The model '{info.id}' has no tool-call parser, so it cannot call a tool as "
            f"tool_choice {choice!r} demands (send tool_choice 'auto' or 'none', or serve a "
            "model with tool calling; see /v1/models).",
            code="tools_unsupported",
            param="tool_choice",
        )
    template_tools = tuple(
        {
            "type": "function",
            "function": {k: v for k, v in d.items() if k not in ("strict", "custom")},
        }
        for d in defs
    )
    customs = tuple(d["custom"] for d in defs if "custom" in d)
    constraint = None
    if mode == "required" or mode.startswith("fn:"):
        chosen = [
            {k: v for k, v in d.items() if k != "custom"}
            | {"param": f"tools[{i}].function.parameters"}
            for i, d in enumerate(defs)
            if mode == "required" or d["name"] == mode[3:]
        ]
        allow_many = parallel is not False and mode == "required"
        only = [d for d in defs if d["name"] == chosen[0]["name"]] if len(chosen) == 1 else []
        try:
            if only and "custom" in only[0]:
                # One custom tool forced: the answer is its input, in its own grammar.
                constraint = custom_constraint(only[0]["custom"])
            else:
                constraint = tool_constraint(
                    chosen, tool_format=tool_format, parallel=allow_many, param="tool_choice"
                )
        except StructureError as exc:
            raise OpenAIError(400, str(exc), code=exc.code, param=exc.param) from None
    return ToolPlan(template_tools, True, constraint, custom=customs)


def plan_tools(
    tools: list[tuple[int, dict[str, Any]]] | None,
    choice: Any,
    parallel: bool | None,
    info: ModelInfo | None,
) -> ToolPlan:
    """:func:`tool_plan` for tools given as
    ``(index in the request, chat-shaped tool)``, its errors named as the request names them
    (``tools[3].name``, not ``tools[1].function.name``, when skipped tools came first)."""
    chat = None if tools is None else [t for _, t in tools]
    try:
        plan = tool_plan(chat, choice, parallel, info)
    except OpenAIError as exc:
        for k, (i, _) in sorted(enumerate(tools or []), reverse=True):
            exc = relabel(exc, f"tools[{k}].function", f"tools[{i}]")
            exc = relabel(exc, f"tools[{k}].custom", f"tools[{i}]")
            exc = relabel(exc, f"tools[{k}]", f"tools[{i}]")
        raise exc from None
    constraint = plan.constraint
    for k, (i, _) in sorted(enumerate(tools or []), reverse=True):
        constraint = renamed(constraint, f"tools[{k}].function", f"tools[{i}]")
    return replace(plan, constraint=constraint)


def renamed(constraint: Constraint | None, old: str, new: str) -> Constraint | None:
    """``constraint`` with its schemas' parameter names as this API names them
    (their limits are checked later, off the event loop; see :func:`relabel`)."""
    if constraint is None:
        return None
    schemas = tuple(
        (param.replace(old, new, 1) if param.startswith(old) else param, schema)
        for param, schema in constraint.schemas
    )
    return replace(constraint, schemas=schemas)


def response_constraint(fmt: Any) -> Constraint | None:
    """``response_format`` (text, json_object, json_schema) as a grammar, or None."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("response_format", "'response_format' must be an object.")
    kind = fmt.get("type")
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return json_constraint({"type": "object"}, strict=False, param="response_format")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad(
                    "response_format.json_schema",
                    "json_schema must be {'name': ..., 'schema': {...}, 'strict': bool}.",
                )
            name = spec.get("name")
            if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
                raise bad("response_format.json_schema.name", f"Invalid schema name {name!r}.")
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad("response_format.json_schema.strict", "'strict' must be a boolean.")
            schema = spec.get("schema") or {}
            return json_constraint(
                schema, strict=bool(strict), param="response_format.json_schema.schema"
            )
    except StructureError as exc:
        raise OpenAIError(400, str(exc), code=exc.code, param=exc.param) from None
    raise bad(
        "response_format.type",
        f"Unknown response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'.",
    )


def template_kwargs(kwargs: Any) -> tuple[tuple[str, object], ...]:
    """``chat_template_kwargs``: extra variables for the chat template."""
    if kwargs is None:
        return ()
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object.")
    reserved = sorted(k for k in kwargs if k in _RESERVED)
    if reserved:
        raise bad(
            "chat_template_kwargs",
            f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them).",
        )
    return tuple(sorted(kwargs.items()))


def history_message(
    m: dict[str, Any], i: int, content: str | list[dict[str, Any]] | None
) -> dict[str, Any]:
    """An assistant message with tool_calls or a tool result, in the template's shape."""
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(f"messages[{i}].tool_call_id", f"messages[{i}] (tool) needs tool_call_id.")
        out["tool_call_id"] = call_id
        if content is None:
            raise bad(f"messages[{i}].content", f"messages[{i}] has no content.")
        return out
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise bad(f"messages[{i}].tool_calls", "tool_calls must be a non-empty list.")
    out["tool_calls"] = [_history_call(c, i, j) for j, c in enumerate(calls)]
    return out


def _history_call(call: Any, i: int, j: int) -> dict[str, Any]:
    param = f"messages[{i}].tool_calls[{j}]"
    if isinstance(call, dict) and call.get("type") == "custom":
        return {
            "id": str(call.get("id") or f"call_{i}_{j}"),
            "type": "function",
            "function": custom.history_call(call, param),
        }
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(
            param, f"{param} must be {{'id', 'type': 'function', 'function': {{name, arguments}}}}."
        )
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise bad(f"{param}.function.arguments", f"{param}'s arguments are not JSON.") from None
    if not isinstance(args, dict):
        raise bad(f"{param}.function.arguments", f"{param}'s arguments must be a JSON object.")
    return {
        "id": str(call.get("id") or f"call_{i}_{j}"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }
