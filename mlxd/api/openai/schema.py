"""OpenAI chat and legacy completion bodies: their Structs, validation, and the engine request.

Bodies are decoded (:mod:`mlxd.api.http.decode`) into these Structs, which
forbid unknown fields. Parameters that exist in the OpenAI API but that mlxd
does not implement are refused explicitly, never ignored silently; shared
bounds are :mod:`mlxd.api.params`.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from mlxd.api import params, reasoning
from mlxd.api.http.errors import OpenAIError
from mlxd.api.images import Images, text_part
from mlxd.api.images import content as content_of
from mlxd.api.openai.tools import history_message, response_constraint, template_kwargs, tool_plan
from mlxd.api.params import bad, unsupported
from mlxd.config import Settings
from mlxd.engine import (
    ChatPrompt,
    GenerationRequest,
    ModelInfo,
    TextPrompt,
    TokenPrompt,
)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Absent or "": the default model of the route's kind ([models.<id>] default).
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    # Accepted and ignored: they change nothing about generation here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # The priority class the request asks for, at most its key's (mlxd.api.priority).
    priority: str | int | None = None
    # Test-only fault injection; refused unless the server enables it.
    mlxd_fault: str | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    # Extension (vLLM, mlx_lm.server): extra chat template variables.
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    # str, [str], [int, ...] or [[int, ...]]; checked in completion_request.
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    # Extension: structured output for raw completions too.
    response_format: dict[str, Any] | None = None


def _text_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(
                    f"messages[{index}].content[{j}]",
                    f"Only text content parts are supported (got {kind!r}).",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(
        f"messages[{index}].content", "Message content must be a string or a list of text parts."
    )


# vLLM's and others' video parts: refused with a clear message (docs/api.md#images).
_VIDEO_PARTS = ("video_url", "video", "input_video")


def _user_content(content: Any, index: int, images: Images) -> str | list[dict[str, Any]]:
    """A user message's content: text, or text and ``image_url`` parts."""
    if not isinstance(content, list):
        return _text_content(content, index)
    parts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(part, dict) and part.get("type") == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if isinstance(image, dict) and image.get("detail") not in (None, "auto", "low", "high"):
                raise bad(f"{where}.image_url.detail", "detail must be auto, low or high.")
            parts.append(images.data_url(url, f"{where}.image_url"))
        elif isinstance(part, dict) and part.get("type") in _VIDEO_PARTS:
            raise bad(where, "Video input is not supported; send the frames as image_url parts.")
        else:
            parts.append(text_part(_text_content([part], index)))
    return content_of(parts)


def _messages(messages: list[dict[str, Any]], images: Images) -> tuple[dict, ...]:
    if not messages:
        raise bad("messages", "'messages' must contain at least one message.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object.")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(
                f"messages[{i}].role",
                f"Invalid role {role!r}: use system, developer, user, assistant or tool.",
            )
        if m.get("function_call"):
            raise unsupported(
                f"messages[{i}].function_call", "the legacy function_call; use tool_calls."
            )
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
        if extra:
            raise bad(
                f"messages[{i}]", f"Unrecognized message field(s): {', '.join(sorted(extra))}."
            )
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):
            content = m.get("content")
            text = None if content is None else _text_content(content, i)
            out.append(history_message(m, i, text))
            continue
        if "content" not in m or m["content"] is None:
            raise bad(f"messages[{i}].content", f"messages[{i}] has no content.")
        text_only = role != "user"
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _text_content(m["content"], i)
                if text_only
                else _user_content(m["content"], i, images),
            }
        )
    return tuple(out)


def _common(
    req: _Common, settings: Settings, *, max_tokens: int | None, faults: bool
) -> dict[str, Any]:
    """What chat and legacy completions share: sampling, penalties, stops, a fault."""
    if req.n not in (None, 1):
        raise unsupported("n", "only n=1 is implemented; send several requests instead.")
    params.stream_options(req.stream_options is not None, req.stream)
    params.metadata(req.metadata)
    max_tokens, asked = params.clamped_max_tokens("max_tokens", max_tokens, settings)
    sampled = params.sampling(
        settings,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
    )
    penalties = params.penalties(
        presence=req.presence_penalty,
        frequency=req.frequency_penalty,
        repetition=req.repetition_penalty,
        logit_bias=req.logit_bias,
    )
    refusal = OpenAIError(
        400,
        "Unrecognized request argument supplied: mlxd_fault",
        code="unknown_parameter",
        param="mlxd_fault",
    )
    return {
        "max_tokens": max_tokens if max_tokens is not None else settings.sampling.max_tokens,
        "max_tokens_asked": asked,
        "sampling": sampled,
        "penalties": penalties,
        "fault": params.fault(req.mlxd_fault, allowed=faults, refusal=refusal),
        "stop": params.stops(req.stop),
    }


def chat_request(
    req: ChatRequest, settings: Settings, *, faults: bool = False, info: ModelInfo | None = None
) -> GenerationRequest:
    """Validate a chat completion and build the engine's request."""
    if req.functions or req.function_call is not None:
        raise unsupported("functions", "the legacy functions/function_call; use tools.")
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, info)
    constraint = response_constraint(req.response_format)
    if constraint is not None and plan.constraint is not None:
        raise bad(
            "response_format",
            "A JSON response_format and a forced tool call (tool_choice 'required' or a named "
            "function) cannot both constrain one answer.",
        )
    if req.modalities and req.modalities != ["text"]:
        raise unsupported("modalities", "mlxd generates text only.")
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(req, name) is not None:
            raise unsupported(name, "not implemented.")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= 20:
            raise bad("top_logprobs", "'top_logprobs' must be between 0 and 20.")
        if not req.logprobs:
            raise bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    common = _common(req, settings, max_tokens=max_tokens, faults=faults)
    images = Images(settings)
    messages = _messages(req.messages, images)
    thinking, budget = reasoning.effort(req.reasoning_effort, settings, "reasoning_effort")
    kwargs = dict(thinking) | dict(template_kwargs(req.chat_template_kwargs))
    return GenerationRequest(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        prompt=ChatPrompt(
            messages,
            plan.tools,
            tuple(sorted(kwargs.items())),
            images=tuple(images.parts),
        ),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        parse_tools=plan.parse,
        tools_ignored=plan.ignored,
        custom_tools=plan.custom,
        reasoning_budget=budget,
        constraint=constraint or plan.constraint,
        **common,
    )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _completion_prompt(prompt: str | list[Any]) -> TextPrompt | TokenPrompt:
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if not prompt:
        raise bad("prompt", "'prompt' must not be empty.")
    if _is_ids(prompt):
        return TokenPrompt(tuple(prompt))
    if len(prompt) > 1 and (
        all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)
    ):
        raise unsupported(
            "prompt", "one prompt per request (send several requests; the server batches them)."
        )
    only = prompt[0] if len(prompt) == 1 else None
    if isinstance(only, str):
        return TextPrompt(only)
    if _is_ids(only) and only:
        return TokenPrompt(tuple(only))
    raise bad(
        "prompt", "'prompt' must be a string, a list of token ids, or a one-element list of either."
    )


def completion_request(
    req: CompletionRequest,
    settings: Settings,
    *,
    faults: bool = False,
    info: ModelInfo | None = None,
) -> GenerationRequest:
    """Validate a legacy completion and build the engine's request."""
    if req.echo:
        raise unsupported("echo", "echoing the prompt is not implemented.")
    if req.suffix:
        raise unsupported("suffix", "insertion (suffix) is not implemented.")
    if req.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is implemented.")
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
        raise bad("logprobs", "'logprobs' must be between 0 and 5 for completions.")
    engine_prompt = _completion_prompt(req.prompt)
    if isinstance(engine_prompt, TextPrompt) and not engine_prompt.text:
        raise bad("prompt", "'prompt' must not be empty.")
    common = _common(req, settings, max_tokens=req.max_tokens, faults=faults)
    return GenerationRequest(
        id=f"cmpl-{uuid.uuid4().hex[:24]}",
        api="completions",
        prompt=engine_prompt,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        constraint=response_constraint(req.response_format),
        **common,
    )
