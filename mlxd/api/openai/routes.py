"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Handlers are thin: read and validate the body (:mod:`mlxd.api.openai.schema`),
then run through :func:`mlxd.api.generate.generate`, the path every API
shares, rendered by :mod:`mlxd.api.openai.render` (:class:`ChatOutput`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath
from litestar.response import Stream

from mlxd.api.answer import Output
from mlxd.api.generate import check_generation, generate
from mlxd.api.http.body import read_body
from mlxd.api.http.caller import caller_of
from mlxd.api.http.decode import decode_parameters
from mlxd.api.http.errors import OpenAIError, without_paths
from mlxd.api.http.requestlog import note_of
from mlxd.api.lease import acquire, check_accepting, released_on_error
from mlxd.api.openai.render import Kind, Renderer, sse_error
from mlxd.api.openai.schema import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
)
from mlxd.api.priority import requested as requested_priority
from mlxd.api.state import AppState, Mlxd
from mlxd.config.registry import resolve
from mlxd.engine import (
    TOOL_GRAMMAR_FORMATS,
    Accepted,
    CacheLookup,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    ModelState,
)


class ChatOutput:
    """The chat and legacy completions rendering (:class:`Renderer`) as an :class:`Output`."""

    def __init__(self, renderer: Renderer, include_usage: bool):
        self.r = renderer
        self.usage = include_usage

    def collect(self, delta: Delta) -> None:
        self.r.collect(delta)

    def response(self, finished: Finished) -> dict[str, Any]:
        return self.r.response(finished)

    def stream_start(self) -> list[bytes]:
        first = self.r.first_chunk(with_usage=self.usage)
        return [first] if first else []

    def stream_delta(self, delta: Delta) -> list[bytes]:
        if self.r.has_output(delta):
            return [self.r.delta_chunk(delta, with_usage=self.usage)]
        return []

    def stream_end(self, finished: Finished) -> list[bytes]:
        return self.r.final_chunks(finished, with_usage=self.usage)

    def stream_error(self, failed: Failed) -> list[bytes]:
        return [sse_error(OpenAIError.from_failed(failed).body())]

    def stream_keepalive(self) -> list[bytes]:
        return [b": keep-alive\n\n"]  # an SSE comment: clients skip it, timers see bytes


class OpenAIController(Controller):
    """``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``."""

    path = "/"

    @get("/models")
    async def list_models(self, request: Request, mlxd: Mlxd) -> dict[str, Any]:
        """Every configured model, or those the request's API key may use."""
        models = _visible(request, mlxd)
        return {"object": "list", "data": [model_json(m) for m in models]}

    @get("/models/{model_id:path}")
    async def get_model(
        self, request: Request, mlxd: Mlxd, model_id: FromPath[str]
    ) -> dict[str, Any]:
        """One model by id, or by an alias that routes to it (its entry, under its id)."""
        visible = _visible(request, mlxd)
        by_id = {m.id: m for m in visible}
        name = model_id.lstrip("/")
        model = by_id.get(name) or (by_id.get(resolve(mlxd.settings, name) or "") if name else None)
        if model is None:
            ids = ", ".join(m.id for m in visible)
            raise OpenAIError(
                404,
                f"The model '{model_id.lstrip('/')}' does not exist (configured: {ids}).",
                code="model_not_found",
                param="model",
            )
        return model_json(model)

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        return await _serve(request, mlxd, "chat")

    @post("/completions", status_code=200)
    async def completions(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        return await _serve(request, mlxd, "completion")


def _visible(request: Request, state: AppState) -> list[ModelState]:
    """The configured models, less those the request's API key may not use (its ``models``)."""
    caller = caller_of(request.scope)
    return [m for m in state.fleet.status().models if caller.may_use(m.id)]


_KINDS: dict[
    Kind, tuple[type[ChatRequest] | type[CompletionRequest], Callable[..., GenerationRequest]]
] = {
    "chat": (ChatRequest, chat_request),
    "completion": (CompletionRequest, completion_request),
}


async def _serve(request: Request, state: AppState, kind: Kind) -> Response[Any] | Stream:
    """Read, validate and run one completion request of either kind."""
    check_accepting(state)
    schema, build = _KINDS[kind]
    body = await read_body(request, state.settings.limits.max_body_bytes)
    policy = state.settings.server.unknown_parameters
    req, headers = decode_parameters(body, schema, policy, request.url.path)
    note_of(request.scope).model = req.model
    asked = requested_priority(req)
    lease = await acquire(state, req.model, request=request)
    with released_on_error(lease):
        gen = build(req, lease.settings, faults=state.fault_injection, info=lease.info)
        await check_generation(
            state, lease, gen, json_param="response_format", tools_param="tool_choice"
        )
    usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)

    def make_output(accepted: Accepted, _lookup: CacheLookup) -> Output:
        renderer = Renderer(
            kind,
            gen.id,
            accepted.model,
            logprobs=gen.logprobs,
            reasoning_field=state.settings.server.reasoning_field,
        )
        return ChatOutput(renderer, usage)

    return await generate(
        request, state, lease, gen, make_output, stream=req.stream, headers=headers, asked=asked
    )


def model_json(model: ModelState) -> dict[str, Any]:
    """One configured model as ``/v1/models`` lists it: OpenAI's fields, then mlxd's."""
    caps = model.capabilities
    tool_format = caps.get("tool_format")
    out: dict[str, Any] = {
        "id": model.id,
        "object": "model",
        "created": int(model.loaded_at or 0),
        "owned_by": "mlxd",
        # Extensions: what the model is, where it stands, what it holds.
        "kind": model.kind,
        "aliases": list(model.aliases),
        "state": model.state,
        "default": model.default,
        "pinned": model.pinned,
        "weights_bytes": model.weights_bytes,
        "kv_bytes": model.kv_bytes,
    }
    if model.error:
        out["error"] = without_paths(model.error)  # clients; /stats keeps the path
    if model.kind == "chat" and caps:
        out["context_length"] = caps.get("context_length")
        out["vocab_size"] = caps.get("vocab_size")
        out["max_token_chars"] = caps.get("max_token_chars")
        # What this model can do beyond plain chat (known once it has been loaded).
        out["capabilities"] = {
            "tools": tool_format is not None,
            "tool_format": tool_format,
            "tool_choice_required": tool_format in TOOL_GRAMMAR_FORMATS,
            # Without a tool parser, tools sent with tool_choice auto are left out.
            "tools_ignored": tool_format is None,
            "structured_output": caps.get("structured_output", False),
            "reasoning": caps.get("reasoning", False),
            # A vision-language model: chat prompts may carry images.
            "vision": caps.get("vision", False),
        }
    elif model.kind in ("embedding", "rerank") and caps:
        out["dimensions"] = caps.get("dimensions")
        out["context_length"] = caps.get("context_length")
        out["vocab_size"] = caps.get("vocab_size")
        # Whether a request's `dimensions` may shorten the vectors (Matryoshka models).
        out["supports_dimensions"] = caps.get("supports_dimensions", False)
        if model.kind == "rerank":  # how it scores: "cross_encoder" or "yes_no_lm"
            out["scoring"] = caps.get("scoring")
    elif model.kind == "transcription" and caps:  # its text decoder's
        out["context_length"] = caps.get("context_length")
        out["vocab_size"] = caps.get("vocab_size")
    elif model.kind == "speech" and caps:  # the audio it makes, the voices it has
        out["sample_rate"] = caps.get("sample_rate")
        out["voices"] = list(caps.get("voices") or ())
    return out
