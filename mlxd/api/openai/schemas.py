"""OpenAI request bodies: decoding, validation and translation to engine requests.

Bodies are decoded with msgspec into Structs that forbid unknown fields, so a
misspelled parameter is a 400 that names it, like OpenAI's own
"Unrecognized request argument". Parameters that exist in the OpenAI API but
that mlxd does not implement are refused explicitly, never ignored silently.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec

from mlxd.api.http.errors import OpenAIError
from mlxd.api.openai.tools import history_message, response_constraint, template_kwargs, tool_plan
from mlxd.config import Settings
from mlxd.engine import (
    ChatPrompt,
    GenerationRequest,
    ModelInfo,
    PenaltyParams,
    SamplingParams,
    TextPrompt,
    TokenPrompt,
)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
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


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")

# Bounds on what a body may carry (docs/api.md, "Limits").
MAX_JSON_DEPTH = 64
MAX_LOGIT_BIAS = 300
MAX_STOP_CHARS = 500
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")
_FAULT = re.compile(r"^(logits_processor|bad_logits)(@[1-9][0-9]{0,5})?$")


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Do arrays and objects nest more than ``limit`` levels in a decoded body?"""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for item in node.values() if type(node) is dict else node:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
    return False


def drop_unknown(raw: dict[str, Any], kind: type[msgspec.Struct]) -> list[str]:
    """Remove the top-level keys ``kind`` does not know from ``raw``; returns their names.

    For ``[server] unknown_parameters = "ignore"``: vendor extras some clients
    always send. Parameters mlxd knows but does not support stay (and get their
    400); nested objects are still checked strictly.
    """
    unknown = [k for k in raw if k not in kind.__struct_fields__]
    for name in unknown:
        del raw[name]
    return unknown


def decode(body: bytes, kind: type[msgspec.Struct], *, ignored: list[str] | None = None) -> Any:
    """Decode and type-check a JSON body, turning every failure into a clear 400.

    With ``ignored`` (a list to fill), unknown top-level parameters are dropped
    and their names appended to it instead of being refused.
    """
    try:
        raw = msgspec.json.decode(body)
    except RecursionError:
        raw = None  # deeper than the interpreter allows: certainly too deep
    except msgspec.DecodeError as exc:
        raise OpenAIError(
            400, f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if raw is None or (isinstance(raw, dict) and too_deep(raw)):
        raise OpenAIError(
            400,
            f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.",
            code="invalid_json",
        )
    if not isinstance(raw, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    if ignored is not None:
        ignored.extend(drop_unknown(raw, kind))
    try:
        return msgspec.convert(raw, kind)
    except RecursionError:
        raise OpenAIError(400, "The request body nests too deeply.", code="invalid_json") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        unknown = _UNKNOWN_FIELD.search(text)
        if unknown:
            name = unknown.group(1)
            raise OpenAIError(
                400,
                f"Unrecognized request argument supplied: {name}",
                code="unknown_parameter",
                param=name,
            ) from None
        path = _AT_PATH.search(text)
        param = path.group(1) if path else None
        if "missing required field" in text:
            missing = re.search(r"`([^`]+)`", text)
            param = missing.group(1) if missing else param
            raise OpenAIError(
                400,
                f"Missing required parameter: '{param}'.",
                code="missing_required_parameter",
                param=param,
            ) from None
        raise OpenAIError(400, f"Invalid value: {text}", code="invalid_type", param=param) from None


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def _unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(
        400,
        f"'{param}' is not supported by mlxd: {what}",
        code="unsupported_parameter",
        param=param,
    )


def _range(name: str, value: float | None, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is None:
        return
    if value != value or value > hi or value < lo or (lo_open and value == lo):
        bound = f"({lo}" if lo_open else f"[{lo}"
        raise _bad(name, f"'{name}' must be in {bound}, {hi}], got {value}.")


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
                raise _bad(
                    f"messages[{index}].content[{j}]",
                    f"Only text content parts are supported (got {kind!r}).",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(
        f"messages[{index}].content", "Message content must be a string or a list of text parts."
    )


def _messages(messages: list[dict[str, Any]]) -> tuple[dict, ...]:
    if not messages:
        raise _bad("messages", "'messages' must contain at least one message.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object.")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(
                f"messages[{i}].role",
                f"Invalid role {role!r}: use system, developer, user, assistant or tool.",
            )
        if m.get("function_call"):
            raise _unsupported(
                f"messages[{i}].function_call", "the legacy function_call; use tool_calls."
            )
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
        if extra:
            raise _bad(
                f"messages[{i}]", f"Unrecognized message field(s): {', '.join(sorted(extra))}."
            )
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):
            content = m.get("content")
            text = None if content is None else _text_content(content, i)
            out.append(history_message(m, i, text))
            continue
        if "content" not in m or m["content"] is None:
            raise _bad(f"messages[{i}].content", f"messages[{i}] has no content.")
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _text_content(m["content"], i),
            }
        )
    return tuple(out)


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 16:
        raise _bad("stop", "At most 16 stop sequences are allowed.")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise _bad("stop", f"A stop sequence may have at most {MAX_STOP_CHARS} characters.")
    return tuple(s for s in stops if s)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """Keys are token ids (checked against the vocabulary at intake), values in [-100, 100]."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad(
            "logit_bias", f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} allowed."
        )
    out = []
    for key, value in bias.items():
        if not _TOKEN_ID.match(key):
            raise _bad(
                "logit_bias", f"logit_bias keys must be token ids (0, 1, 2, ...), got {key[:40]!r}."
            )
        _range("logit_bias", value, -100, 100)
        out.append((int(key), float(value)))
    return tuple(out)


def _seed(seed: int | None) -> int | None:
    """Seeds are 64-bit: [-2**63, 2**64 - 1]; a negative one is taken modulo 2**64."""
    if seed is None:
        return None
    if not SEED_MIN <= seed <= SEED_MAX:
        raise _bad("seed", f"'seed' must be between {SEED_MIN} and {SEED_MAX}, got {seed}.")
    return seed % 2**64


def _common(
    req: _Common, settings: Settings, *, max_tokens: int | None, faults: bool
) -> dict[str, Any]:
    if req.n not in (None, 1):
        raise _unsupported("n", "only n=1 is implemented; send several requests instead.")
    if max_tokens is not None:
        if max_tokens < 1:
            raise _bad("max_tokens", f"'max_tokens' must be at least 1, got {max_tokens}.")
        limit = settings.limits.max_tokens
        if max_tokens > limit:
            raise _bad(
                "max_tokens", f"'max_tokens' is {max_tokens}; this server allows at most {limit}."
            )
    _range("temperature", req.temperature, 0, 2)
    _range("top_p", req.top_p, 0, 1, lo_open=True)
    _range("min_p", req.min_p, 0, 1)
    _range("presence_penalty", req.presence_penalty, -2, 2)
    _range("frequency_penalty", req.frequency_penalty, -2, 2)
    _range("repetition_penalty", req.repetition_penalty, 0, 10, lo_open=True)
    if req.top_k is not None and req.top_k < 0:
        raise _bad("top_k", f"'top_k' must be >= 0, got {req.top_k}.")
    if req.mlxd_fault is not None and not faults:
        raise OpenAIError(
            400,
            "Unrecognized request argument supplied: mlxd_fault",
            code="unknown_parameter",
            param="mlxd_fault",
        )
    if req.mlxd_fault is not None and not _FAULT.match(req.mlxd_fault):
        raise _bad("mlxd_fault", f"unknown fault {req.mlxd_fault!r}")
    d = settings.sampling
    return {
        "max_tokens": max_tokens if max_tokens is not None else d.max_tokens,
        "sampling": SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=_seed(req.seed),
        ),
        "penalties": PenaltyParams(
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=_logit_bias(req.logit_bias),
        ),
        "stop": _stop(req.stop),
        "fault": req.mlxd_fault,
    }


def chat_request(
    req: ChatRequest, settings: Settings, *, faults: bool = False, info: ModelInfo | None = None
) -> GenerationRequest:
    """Validate a chat completion and build the engine's request."""
    if req.functions or req.function_call is not None:
        raise _unsupported("functions", "the legacy functions/function_call; use tools.")
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, info)
    constraint = response_constraint(req.response_format)
    if constraint is not None and plan.constraint is not None:
        raise _bad(
            "response_format",
            "A JSON response_format and a forced tool call (tool_choice 'required' or a named "
            "function) cannot both constrain one answer.",
        )
    if req.modalities and req.modalities != ["text"]:
        raise _unsupported("modalities", "mlxd generates text only.")
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(req, name) is not None:
            raise _unsupported(name, "not implemented.")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= 20:
            raise _bad("top_logprobs", "'top_logprobs' must be between 0 and 20.")
        if not req.logprobs:
            raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    common = _common(req, settings, max_tokens=max_tokens, faults=faults)
    return GenerationRequest(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        prompt=ChatPrompt(
            _messages(req.messages), plan.tools, template_kwargs(req.chat_template_kwargs)
        ),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        parse_tools=plan.parse,
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
        raise _bad("prompt", "'prompt' must not be empty.")
    if _is_ids(prompt):
        return TokenPrompt(tuple(prompt))
    if len(prompt) > 1 and (
        all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)
    ):
        raise _unsupported(
            "prompt", "one prompt per request (send several requests; the server batches them)."
        )
    only = prompt[0] if len(prompt) == 1 else None
    if isinstance(only, str):
        return TextPrompt(only)
    if _is_ids(only) and only:
        return TokenPrompt(tuple(only))
    raise _bad(
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
        raise _unsupported("echo", "echoing the prompt is not implemented.")
    if req.suffix:
        raise _unsupported("suffix", "insertion (suffix) is not implemented.")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", "only best_of=1 is implemented.")
    if req.logprobs is not None and not 0 <= req.logprobs <= 5:
        raise _bad("logprobs", "'logprobs' must be between 0 and 5 for completions.")
    engine_prompt = _completion_prompt(req.prompt)
    if isinstance(engine_prompt, TextPrompt) and not engine_prompt.text:
        raise _bad("prompt", "'prompt' must not be empty.")
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
