"""What the in-process translation tests share: a served model, settings, SSE parsing.

No daemon, no MLX: request bodies go through the API's own decode and
translate functions, engine events through its renderers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import pytest

from mlxd.api.grammar import prepare
from mlxd.api.http.errors import OpenAIError
from mlxd.config import LimitSettings, SamplingSettings, Settings
from mlxd.engine import ChatPrompt, Finished, FinishReason, GenerationRequest, ModelInfo, Usage
from mlxd.engine.messages import Timings

T = TypeVar("T", bound=msgspec.Struct)

# A served chat model as the HTTP side sees it: Hermes-style tool calls, a grammar-capable
# tokenizer, think markers.
INFO = ModelInfo(
    id="tiny",
    path="/models/tiny",
    family="llama",
    context_length=2048,
    created=0,
    batchable=True,
    vocab_size=600,
    tool_format="json_tools",
    reasoning=True,
    structured_output=True,
)
# The same model without a tool-call parser.
NO_TOOLS = ModelInfo(
    id="plain", path="/models/plain", family="llama", context_length=2048, created=0, batchable=True
)
# Defaults that differ from the request values the tests send, so each side is visible.
SETTINGS = Settings(
    sampling=SamplingSettings(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, max_tokens=100),
    limits=LimitSettings(max_tokens=256),
)
TIMINGS = Timings(queue_s=0.0, prefill_s=0.01, decode_s=0.02, ttft_s=0.01, total_s=0.03)


def body_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def decoded(body: dict[str, Any], kind: type[T]) -> T:
    """``body`` through the API's own decoder (the route's first step)."""
    from mlxd.api.http.decode import decode

    return decode(body_bytes(body), kind)


def chat_prompt(gen: GenerationRequest) -> ChatPrompt:
    """``gen``'s prompt, which must be chat messages."""
    assert isinstance(gen.prompt, ChatPrompt), gen.prompt
    return gen.prompt


def refused(build: Callable[..., Any], *args: Any, **kw: Any) -> OpenAIError:
    """The 400 (or other) the request ``build(*args, **kw)`` makes gets before it is queued.

    That is the translation's refusal, or else its grammar's: the schema
    checks and llguidance's validation the route runs off the event loop
    (:func:`mlxd.api.grammar.prepare`, here without a model's tokenizer).
    """
    with pytest.raises(OpenAIError) as err:
        built = build(*args, **kw)
        constraint = getattr(getattr(built, "gen", built), "constraint", None)
        if constraint is not None:
            prepare(None, constraint, param="(the grammar)")
    return err.value


def finished(
    reason: FinishReason = "stop",
    *,
    prompt: int = 12,
    completion: int = 5,
    cached: int = 0,
    stop_sequence: str | None = None,
) -> Finished:
    return Finished(
        reason,
        Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
        TIMINGS,
        stop_sequence=stop_sequence,
    )


def data_lines(chunks: list[bytes]) -> list[Any]:
    """OpenAI chat SSE: each ``data: ...`` payload, JSON decoded (``[DONE]`` kept as text)."""
    out: list[Any] = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"), chunk
        payload = chunk[len(b"data: ") : -2]
        out.append("[DONE]" if payload == b"[DONE]" else msgspec.json.decode(payload))
    return out


def named_events(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Responses / Anthropic SSE: ``(event name, data)`` per chunk; the names must agree."""
    out = []
    for chunk in chunks:
        head, _, rest = chunk.partition(b"\n")
        assert head.startswith(b"event: ") and rest.startswith(b"data: "), chunk
        assert rest.endswith(b"\n\n"), chunk
        name = head[len(b"event: ") :].decode()
        data = msgspec.json.decode(rest[len(b"data: ") : -2])
        assert data["type"] == name
        out.append((name, data))
    return out
