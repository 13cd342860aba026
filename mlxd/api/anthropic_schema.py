"""``POST /v1/messages`` bodies (Anthropic Messages API): decoding, validation, translation.

``system`` and ``messages`` (content blocks) become the same chat messages a
chat completion builds, so the request runs through the same engine path.
Errors are :class:`~mlxd.api.errors.OpenAIError` like everywhere else; under
``/v1/messages`` the app answers them in Anthropic's envelope.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.api.responses_schema import sampling
from mlxd.api.schemas import _bad, _stop, _unsupported
from mlxd.config import Settings
from mlxd.engine.messages import ChatPrompt, GenerationRequest


class _MessagesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
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


def _block_text(block: Any, where: str) -> str | None:
    """A block's text; None for blocks that carry nothing the model reads again."""
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        raise _bad(where, f"A content block must be an object, got {type(block).__name__}.")
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise _bad(f"{where}.text", "A text block needs a string 'text'.")
        return block["text"]
    if kind in ("thinking", "redacted_thinking"):
        return None  # earlier reasoning is not fed back, as Anthropic's own API does
    if kind in ("tool_use", "tool_result", "server_tool_use"):
        raise _unsupported(
            where, f"'{kind}' blocks need tool calling, which is not implemented yet."
        )
    if kind in ("image", "document", "search_result"):
        raise _unsupported(where, f"mlxd serves a text model; {kind!r} blocks are not accepted.")
    raise _bad(f"{where}.type", f"Unknown content block type {kind!r}.")


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (_block_text(b, f"{where}[{j}]") for j, b in enumerate(content))
        return "".join(t for t in texts if t is not None)
    raise _bad(where, "'content' must be a string or a list of content blocks.")


def _system(system: str | list[dict[str, Any]] | None) -> tuple[dict, ...]:
    if system is None:
        return ()
    text = _content(system, "system")
    return ({"role": "system", "content": text},) if text else ()


def chat_messages(body: _MessagesBody) -> tuple[dict, ...]:
    """``system`` and ``messages`` as the chat messages the engine renders."""
    if not body.messages:
        raise _bad("messages", "'messages' must contain at least one message.")
    out = list(_system(body.system))
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "A message must be an object.")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role", f"Invalid role {role!r}: use 'user' or 'assistant'.")
        extra = set(m) - {"role", "content"}
        if extra:
            raise _bad(where, f"Extra inputs are not permitted: {', '.join(sorted(extra))}.")
        if "content" not in m:
            raise _bad(f"{where}.content", f"{where} has no content.")
        out.append({"role": role, "content": _content(m["content"], f"{where}.content")})
    if out[-1]["role"] == "assistant":
        raise _unsupported(
            f"messages[{len(body.messages) - 1}]",
            "a final assistant message (prefill) is not continued by mlxd; end with a user turn.",
        )
    return tuple(out)


def _refuse_unsupported(body: _MessagesBody) -> None:
    if body.tools:
        raise _unsupported("tools", "tool calling is not implemented yet.")
    if body.tool_choice is not None and body.tool_choice.get("type") not in ("auto", "none"):
        raise _unsupported("tool_choice", "tool calling is not implemented yet.")
    if body.output_config and body.output_config.get("format") is not None:
        raise _unsupported("output_config.format", "structured output is not implemented yet.")


def count_tokens_request(body: CountTokensRequest) -> GenerationRequest:
    """The prompt of a count_tokens request, as the engine would tokenize it."""
    _refuse_unsupported(body)
    return GenerationRequest(
        id=f"count_{uuid.uuid4().hex[:24]}",
        prompt=ChatPrompt(chat_messages(body)),
        max_tokens=1,
        api="messages",
    )


def messages_request(
    req: MessagesRequest, settings: Settings, *, faults: bool = False
) -> MessagesCall:
    """Validate a Messages request and build the engine's request."""
    _refuse_unsupported(req)
    if req.container is not None:
        raise _unsupported("container", "containers (code execution) are not implemented.")
    if req.mcp_servers:
        raise _unsupported("mcp_servers", "remote MCP servers are not implemented.")
    if req.mlxd_fault is not None and not faults:
        raise _bad("mlxd_fault", "Extra inputs are not permitted: mlxd_fault.")
    if req.max_tokens < 1:
        raise _bad("max_tokens", f"'max_tokens' must be at least 1, got {req.max_tokens}.")
    limit = settings.limits.max_tokens
    if req.max_tokens > limit:
        raise _bad(
            "max_tokens", f"'max_tokens' is {req.max_tokens}; this server allows at most {limit}."
        )
    sampled = sampling(settings, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    if req.temperature is not None and req.temperature > 1:
        raise _bad("temperature", f"'temperature' must be in [0, 1], got {req.temperature}.")
    gen = GenerationRequest(
        id=f"msg_{uuid.uuid4().hex[:24]}",
        prompt=ChatPrompt(chat_messages(req)),
        max_tokens=req.max_tokens,
        sampling=sampled,
        stop=_stop(req.stop_sequences),
        api="messages",
        fault=req.mlxd_fault,
    )
    return MessagesCall(gen=gen, stream=bool(req.stream))
