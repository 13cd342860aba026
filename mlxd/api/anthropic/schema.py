"""``POST /v1/messages`` bodies (Anthropic Messages API): decoding, validation, translation.

``system`` and ``messages`` (content blocks) become the same chat messages a
chat completion builds, so the request runs through the same engine path.
Errors are :class:`~mlxd.api.http.errors.OpenAIError` like everywhere else; under
``/v1/messages`` the app answers them in Anthropic's envelope.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.api import params, reasoning
from mlxd.api.anthropic.blocks import content_text, turn
from mlxd.api.anthropic.system import join_reminder, merge_system
from mlxd.api.http.errors import OpenAIError
from mlxd.api.images import Images
from mlxd.api.openai.tools import (
    ToolPlan,
    history_message,
    plan_tools,
    renamed,
    response_constraint,
)
from mlxd.api.params import bad, relabel, unsupported
from mlxd.config import Settings
from mlxd.engine import ChatPrompt, Constraint, GenerationRequest, ModelInfo


class _MessagesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Absent or "": the default model of the route's kind ([models.<id>] default).
    model: str = ""
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Accepted and ignored: they change nothing about generation here.
    cache_control: dict[str, Any] | None = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None


class MessagesRequest(_MessagesBody, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # The priority class the request asks for, at most its key's (mlxd.api.priority).
    priority: str | int | None = None
    # Refused unless they ask for nothing.
    container: Any = None
    mcp_servers: list[Any] | None = None
    # Test-only fault injection; refused unless the server enables it.
    mlxd_fault: str | None = None


class CountTokensRequest(_MessagesBody, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""


@dataclass(frozen=True)
class MessagesCall:
    gen: GenerationRequest
    stream: bool


def _system(system: str | list[dict[str, Any]] | None) -> tuple[dict, ...]:
    if system is None:
        return ()
    text = content_text(system, "system")
    return ({"role": "system", "content": text},) if text else ()


def chat_messages(body: _MessagesBody, images: Images) -> tuple[dict, ...]:
    """``system`` and ``messages`` as chat messages in the template's shape."""
    if not body.messages:
        raise bad("messages", "'messages' must contain at least one message.")
    out = list(_system(body.system))
    calls: set[str] = set()  # the tool_use ids of the previous assistant message
    leading = True  # no user or assistant message yet
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "A message must be an object.")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(
                f"{where}.role", f"Invalid role {role!r}: use 'user', 'assistant' or 'system'."
            )
        extra = set(m) - {"role", "content"}
        if extra:
            raise bad(where, f"Extra inputs are not permitted: {', '.join(sorted(extra))}.")
        if "content" not in m:
            raise bad(f"{where}.content", f"{where} has no content.")
        if role == "system":
            merge_system(out, content_text(m["content"], f"{where}.content"), leading=leading)
            continue
        leading = False
        msgs = turn(role, m["content"], f"{where}.content", images)
        _check_results(msgs, calls, where)
        calls = {c["id"] for msg in msgs for c in msg.get("tool_calls") or ()}
        for msg in msgs:
            if msg["role"] == "tool" or msg.get("tool_calls"):
                try:
                    msg = history_message(msg, i, msg.get("content"))
                except OpenAIError as exc:
                    raise relabel(exc, f"messages[{i}].tool_calls", f"{where}.content") from None
            if not join_reminder(out, msg):
                out.append(msg)
    out = [{k: v for k, v in msg.items() if k != "mlxd_reminder"} for msg in out]
    if not any(msg["role"] != "system" for msg in out):
        raise bad("messages", "'messages' needs a user message, not only system messages.")
    if out[-1]["role"] == "assistant":
        raise unsupported(
            f"messages[{len(body.messages) - 1}]",
            "a final assistant message (prefill) is not continued by mlxd; end with a user turn.",
        )
    return tuple(out)


def _check_results(turn: list[dict], calls: set[str], where: str) -> None:
    """Each tool_result answers a tool_use of the assistant message just before (as Anthropic)."""
    for msg in turn:
        if msg["role"] != "tool":
            continue
        call_id = msg["tool_call_id"]
        if call_id not in calls:
            known = ", ".join(sorted(calls)) or "none"
            raise bad(
                f"{where}.content",
                f"{where}: the tool_result for tool_use_id {call_id[:100]!r} has no matching "
                f"tool_use block in the previous assistant message (its tool_use ids: {known}).",
            )


# Anthropic tool types that run on Anthropic's side, or that a client
# implements with a schema only Claude knows: skipped, like hosted tools on
# /v1/responses. Naming one in tool_choice is refused by tool_plan.
_CLIENT_TOOL_TYPES = (None, "custom")


def _tools(tools: list[dict[str, Any]] | None) -> list[tuple[int, dict[str, Any]]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}]", f"tools[{i}] must be an object.")
        if tool.get("type") not in _CLIENT_TOOL_TYPES:
            continue
        if "input_schema" not in tool:
            raise bad(f"tools[{i}].input_schema", f"tools[{i}] needs an 'input_schema'.")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append((i, {"type": "function", "function": fn}))
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as the chat one, and whether parallel calls are allowed."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad(
        "tool_choice.type", f"Unknown tool_choice type {kind!r}: use auto, any, tool or none."
    )


def _plan(body: _MessagesBody, info: ModelInfo | None) -> ToolPlan:
    choice, parallel = _tool_choice(body.tool_choice)
    return plan_tools(_tools(body.tools), choice, parallel, info)


def _format(body: _MessagesBody) -> Constraint | None:
    fmt = (body.output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad(
            "output_config.format",
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}.",
        )
    spec = {"name": "output", "schema": fmt.get("schema"), "strict": True}
    try:
        constraint = response_constraint({"type": "json_schema", "json_schema": spec})
        return renamed(
            constraint, "response_format.json_schema.schema", "output_config.format.schema"
        )
    except OpenAIError as exc:
        exc = relabel(exc, "response_format.json_schema.schema", "output_config.format.schema")
        raise relabel(exc, "response_format", "output_config.format") from None


def _prompt(
    body: _MessagesBody, info: ModelInfo | None, settings: Settings
) -> tuple[ChatPrompt, ToolPlan, Constraint | None]:
    plan = _plan(body, info)
    constraint = _format(body)
    if constraint is not None and plan.constraint is not None:
        raise bad(
            "output_config.format",
            "A JSON output format and a forced tool call (tool_choice any or tool) cannot "
            "both constrain one answer.",
        )
    images = Images(settings)
    messages = chat_messages(body, images)
    kwargs, _ = reasoning.anthropic(body.thinking, body.output_config, settings)
    prompt = ChatPrompt(messages, plan.tools, kwargs, images=tuple(images.parts))
    return prompt, plan, constraint


def count_tokens_request(
    body: CountTokensRequest, settings: Settings, *, info: ModelInfo | None = None
) -> GenerationRequest:
    """The prompt of a count_tokens request (tools included), as the engine would tokenize it."""
    prompt, _, _ = _prompt(body, info, settings)
    return GenerationRequest(
        id=f"count_{uuid.uuid4().hex[:24]}", prompt=prompt, max_tokens=1, api="messages"
    )


MAX_USER_ID = 256


def _metadata(metadata: dict[str, Any] | None) -> None:
    """Anthropic's ``metadata``: only ``user_id``, a string of at most 256 characters."""
    if metadata is None:
        return
    extra = sorted(set(metadata) - {"user_id"})
    if extra:
        raise bad(
            f"metadata.{extra[0][:64]}",
            f"metadata.{extra[0][:64]}: Extra inputs are not permitted (metadata takes 'user_id').",
        )
    user = metadata.get("user_id")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_ID):
        raise bad(
            "metadata.user_id",
            f"metadata.user_id must be a string of at most {MAX_USER_ID} characters.",
        )


def messages_request(
    req: MessagesRequest, settings: Settings, *, faults: bool = False, info: ModelInfo | None = None
) -> MessagesCall:
    """Validate a Messages request and build the engine's request."""
    if req.container is not None:
        raise unsupported("container", "containers (code execution) are not implemented.")
    if req.mcp_servers:
        raise unsupported("mcp_servers", "remote MCP servers are not implemented.")
    refusal = bad("mlxd_fault", "Extra inputs are not permitted: mlxd_fault.")
    fault = params.fault(req.mlxd_fault, allowed=faults, refusal=refusal)
    # Agents ask for long budgets (Claude Code: 32000) and expect the server to
    # stop at its own limit: clamped, the answer ends with stop_reason max_tokens.
    max_tokens, asked = params.clamped_max_tokens("max_tokens", req.max_tokens, settings)
    _metadata(req.metadata)
    sampled = params.sampling(
        settings, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k
    )
    if req.temperature is not None and req.temperature > 1:
        raise bad("temperature", f"'temperature' must be in [0, 1], got {req.temperature}.")
    prompt, plan, constraint = _prompt(req, info, settings)
    gen = GenerationRequest(
        id=f"msg_{uuid.uuid4().hex[:24]}",
        prompt=prompt,
        max_tokens=max_tokens,
        max_tokens_asked=asked,
        sampling=sampled,
        stop=params.stops(req.stop_sequences, "stop_sequences"),
        parse_tools=plan.parse,
        tools_ignored=plan.ignored,
        constraint=constraint or plan.constraint,
        api="messages",
        fault=fault,
        reasoning_budget=reasoning.anthropic(req.thinking, req.output_config, settings)[1],
    )
    return MessagesCall(gen=gen, stream=bool(req.stream))
