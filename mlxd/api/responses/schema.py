"""``POST /v1/responses`` bodies: decoding, validation and translation to engine requests.

The OpenAI Responses API takes ``input`` items instead of chat messages. They
are translated into the same :class:`ChatPrompt` a chat completion builds, so
the request runs through the same engine path. Every top-level field of the
current API is known here: the ones that change nothing about generation on a
single local model are accepted and ignored (listed in docs/api.md), the ones
mlxd cannot honour are refused by name, and an unknown field is a 400.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.api import params, reasoning
from mlxd.api.http.errors import OpenAIError
from mlxd.api.images import Images
from mlxd.api.openai.tools import plan_tools
from mlxd.api.params import bad, unsupported
from mlxd.api.responses.items import (
    chat_tool_choice,
    chat_tools,
    input_messages,
    resolve_images,
    text_constraint,
)
from mlxd.config import Settings
from mlxd.engine import ChatPrompt, GenerationRequest, ModelInfo, SamplingParams


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Absent or "": the default model of the route's kind ([models.<id>] default).
    model: str = ""
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    # Refused unless they ask for nothing.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    truncation: str | None = None
    # Accepted and ignored: they change nothing about generation here.
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # The priority class the request asks for, at most its key's (mlxd.api.priority).
    priority: str | int | None = None
    user: str | None = None
    context_management: Any = None
    client_metadata: dict[str, Any] | None = None
    # Codex's warm-up: ``false`` prefills the prompt (warming the prompt
    # cache) and answers with no output.
    generate: bool | None = None
    # Test-only fault injection; refused unless the server enables it.
    mlxd_fault: str | None = None


@dataclass(frozen=True)
class ResponsesCall:
    """A validated Responses request: what the engine runs, and what the answer echoes."""

    gen: GenerationRequest
    # The conversation without the instructions (what a stored response keeps).
    history: tuple[dict, ...]
    echo: dict[str, Any]
    store: bool
    stream: bool
    # False for a warm-up request: the answer carries no output.
    generate: bool = True


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise unsupported("background", "background responses are not implemented.")
    if req.conversation is not None:
        raise unsupported(
            "conversation", "conversations are not implemented; use previous_response_id."
        )
    if req.prompt is not None:
        raise unsupported("prompt", "stored prompt templates are not implemented.")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "logprobs are not implemented on /v1/responses.")
    if req.truncation not in (None, "disabled"):
        raise unsupported(
            "truncation", "only 'disabled' is implemented: a prompt too long is a 400."
        )


def responses_request(
    req: ResponsesRequest,
    settings: Settings,
    previous: tuple[dict, ...] = (),
    *,
    faults: bool = False,
    info: ModelInfo | None = None,
) -> ResponsesCall:
    """Validate a Responses request and build the engine's request.

    Args:
        previous: The stored conversation ``previous_response_id`` names
            (already looked up by the caller), prepended to ``input``.
    """
    _refuse_unsupported(req)
    refusal = OpenAIError(
        400,
        "Unrecognized request argument supplied: mlxd_fault",
        code="unknown_parameter",
        param="mlxd_fault",
    )
    fault = params.fault(req.mlxd_fault, allowed=faults, refusal=refusal)
    cap, asked = params.clamped_max_tokens("max_output_tokens", req.max_output_tokens, settings)
    params.metadata(req.metadata)
    params.stream_options(req.stream_options is not None, req.stream)
    sampled = params.sampling(settings, temperature=req.temperature, top_p=req.top_p)
    new = input_messages(req.input)
    if not new:
        raise bad("input", "'input' must contain at least one message.")
    history = (*previous, *new)
    system = ({"role": "system", "content": req.instructions},) if req.instructions else ()
    plan = plan_tools(
        chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls, info
    )
    constraint = text_constraint(req.text)
    if constraint is not None and plan.constraint is not None:
        raise bad(
            "text.format",
            "A JSON text.format and a forced tool call (tool_choice 'required' or a named "
            "function) cannot both constrain one answer.",
        )
    thinking, budget = reasoning.effort(
        (req.reasoning or {}).get("effort"), settings, "reasoning.effort"
    )
    images = Images(settings)
    max_tokens = cap or settings.sampling.max_tokens
    if req.generate is False:
        max_tokens = 1
    gen = GenerationRequest(
        id=f"resp_{uuid.uuid4().hex}",
        prompt=ChatPrompt(
            resolve_images((*system, *history), images),
            plan.tools,
            thinking,
            images=tuple(images.parts),
        ),
        max_tokens=max_tokens,
        max_tokens_asked=asked,
        sampling=sampled,
        parse_tools=plan.parse,
        tools_ignored=plan.ignored,
        custom_tools=plan.custom,
        reasoning_budget=budget,
        constraint=constraint or plan.constraint,
        api="responses",
        fault=fault,
    )
    return ResponsesCall(
        gen=gen,
        history=history,
        echo=_echo(req, sampled),
        store=req.store is not False,
        stream=bool(req.stream),
        generate=req.generate is not False,
    )


def _echo(req: ResponsesRequest, sampled: SamplingParams) -> dict[str, Any]:
    """The request fields a Response object repeats back."""
    reasoning = req.reasoning or {}
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": reasoning.get("effort"),
            "summary": reasoning.get("summary"),
        },
        "store": req.store is not False,
        "temperature": sampled.temperature,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [t for t in req.tools or [] if t.get("type") in ("function", "custom")],
        "top_p": sampled.top_p,
        "truncation": "disabled",
        "user": req.user,
        "background": False,
        "service_tier": "default",
    }
