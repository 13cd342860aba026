"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Handlers are thin: read and validate the body, submit to the engine, wait for
it to accept (or refuse) the request, then answer with JSON or an SSE stream.
A client that goes away cancels its generation at the next token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from litestar.response import Stream

from mlxd.api.body import read_body
from mlxd.api.errors import OpenAIError
from mlxd.api.render import Kind, Renderer, sse_error
from mlxd.api.requestlog import note_of
from mlxd.api.schemas import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    decode,
)
from mlxd.api.state import AppState, Mlxd, provide_app_state
from mlxd.engine.channel import RequestHandle
from mlxd.engine.checks import IntakeError, check_request
from mlxd.engine.lanes import LaneDecision
from mlxd.engine.messages import Delta, Failed, Finished, GenerationRequest
from mlxd.engine.structure import TOOL_GRAMMAR_FORMATS

logger = logging.getLogger(__name__)


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """``/v1`` needs ``Authorization: Bearer <key>`` when ``[server] api_keys`` is set."""
    keys = connection.app.state.mlxd.settings.server.api_keys
    if not keys:
        return
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        given = token.encode()
        if any(hmac.compare_digest(given, k.get_secret_value().encode()) for k in keys):
            return
    raise OpenAIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
    )


def _check_accepting(state: AppState) -> None:
    if state.shutting_down:
        raise OpenAIError(
            503,
            "The server is shutting down; retry on another instance or later.",
            code="shutting_down",
        )


def _check_model(state: AppState, requested: str) -> None:
    info = state.engine.model_info
    if info is None:
        raise OpenAIError(503, "No model is loaded yet; see /ready.", code="model_not_loaded")
    if requested != info.id:
        raise OpenAIError(
            404,
            f"The model '{requested}' does not exist. "
            f"This server serves '{info.id}' (see /v1/models).",
            code="model_not_found",
            param="model",
        )


def check_values(state: AppState, gen: GenerationRequest) -> None:
    """Token ids and prompt size against the served model, before anything is queued."""
    info = state.engine.model_info
    if info is None:
        return
    try:
        check_request(gen, info)
    except IntakeError as exc:
        raise OpenAIError(400, str(exc), code=exc.code, param=exc.param) from None


async def _watch_disconnect(request: Request, handle: RequestHandle) -> None:
    """Cancel ``handle`` when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def _sse(
    handle: RequestHandle, renderer: Renderer, include_usage: bool, done: Callable[[Any], None]
) -> AsyncIterator[bytes]:
    try:
        first = renderer.first_chunk(with_usage=include_usage)
        if first:
            yield first
        async for event in handle.events():
            if isinstance(event, Delta):
                if renderer.has_output(event):
                    yield renderer.delta_chunk(event, with_usage=include_usage)
            elif isinstance(event, Finished):
                done(event)
                for chunk in renderer.final_chunks(event, with_usage=include_usage):
                    yield chunk
            elif isinstance(event, Failed):
                done(event)
                yield sse_error(OpenAIError.from_failed(event).body())
    finally:
        handle.cancel()  # a no-op once finished; stops generation if the client left


async def _generate(
    request: Request,
    state: AppState,
    gen: GenerationRequest,
    *,
    kind: Kind,
    stream: bool,
    include_usage: bool,
    headers: dict[str, str] | None = None,
) -> Response[Any] | Stream:
    handle = state.engine.submit(gen)
    watcher = asyncio.create_task(_watch_disconnect(request, handle))
    try:
        accepted = await handle.accepted()
        if isinstance(accepted, Failed):
            raise OpenAIError.from_failed(accepted)
        renderer = Renderer(
            kind,
            gen.id,
            accepted.model,
            logprobs=gen.logprobs,
            reasoning_field=state.settings.server.reasoning_field,
        )
        headers = {
            **(headers or {}),
            "X-Mlxd-Lane": LaneDecision(accepted.lane, accepted.reason).header,
            "X-Request-Id": gen.id,
        }
        note = note_of(request.scope)
        note.accepted(accepted)

        def done(outcome: Finished | Failed) -> None:
            note.ended(outcome)
            state.observe(accepted, outcome)

        if stream:
            watcher.cancel()  # the streaming response listens for disconnects itself
            headers["Cache-Control"] = "no-cache"
            body = _sse(handle, renderer, include_usage, done)
            return Stream(body, media_type="text/event-stream", headers=headers)
        async for event in handle.events():
            if isinstance(event, Delta):
                renderer.collect(event)
            elif isinstance(event, Finished):
                done(event)
                return Response(renderer.response(event), headers=headers)
            elif isinstance(event, Failed):
                done(event)
                raise OpenAIError.from_failed(event)
        raise OpenAIError(
            500, "the engine ended the request without an answer", code="internal_error"
        )
    except BaseException:
        handle.cancel()
        raise
    finally:
        if not stream:
            watcher.cancel()


class OpenAIController(Controller):
    path = "/v1"
    guards = [api_key_guard]
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}

    @get("/models")
    async def list_models(self, mlxd: Mlxd) -> dict[str, Any]:
        info = mlxd.engine.model_info
        data = [] if info is None else [_model_json(info)]
        return {"object": "list", "data": data}

    @get("/models/{model_id:str}")
    async def get_model(self, mlxd: Mlxd, model_id: FromPath[str]) -> dict[str, Any]:
        _check_model(mlxd, model_id)
        return _model_json(mlxd.engine.model_info)

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        return await _serve(request, mlxd, "chat")

    @post("/completions", status_code=200)
    async def completions(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        return await _serve(request, mlxd, "completion")


_KINDS: dict[Kind, tuple[type, Callable[..., GenerationRequest]]] = {
    "chat": (ChatRequest, chat_request),
    "completion": (CompletionRequest, completion_request),
}


async def _serve(request: Request, state: AppState, kind: Kind) -> Response[Any] | Stream:
    """Read, validate and run one completion request of either kind."""
    _check_accepting(state)
    schema, build = _KINDS[kind]
    body = await read_body(request, state.settings.limits.max_body_bytes)
    ignored: list[str] | None = [] if state.settings.server.unknown_parameters == "ignore" else None
    req = decode(body, schema, ignored=ignored)
    note_of(request.scope).model = req.model
    headers = {}
    if ignored:
        logger.debug("%s: ignored unknown parameters %s", request.url.path, ignored)
        headers[IGNORED_HEADER] = ignored_header(ignored)
    _check_model(state, req.model)
    gen = build(req, state.settings, faults=state.fault_injection, info=state.engine.model_info)
    check_values(state, gen)
    if gen.constraint is not None:
        warmed = await state.engine.warm_grammar(gen.constraint)
        if isinstance(warmed, tuple):
            for observe in state.compile_observers:
                observe(*warmed)
        elif warmed is not None:
            raise OpenAIError(
                400,
                f"The grammar cannot be compiled for this model: {warmed}",
                code="invalid_schema",
                param="response_format" if gen.constraint.kind == "json" else "tool_choice",
            )
    usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return await _generate(
        request, state, gen, kind=kind, stream=req.stream, include_usage=usage, headers=headers
    )


IGNORED_HEADER = "X-Mlxd-Ignored-Parameters"
_HEADER_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def ignored_header(names: list[str], limit: int = 20) -> str:
    """The ignored names for a response header: safe characters only, at most ``limit``."""
    safe = sorted({n for n in names if _HEADER_SAFE.match(n)})
    shown = safe[:limit]
    rest = len(names) - len(shown)
    return ", ".join(shown + ([f"({rest} more)"] if rest else []))


def _model_json(info: Any) -> dict[str, Any]:
    return {
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": "mlxd",
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "max_token_chars": info.max_token_chars,
        # Extension: what this model can do beyond plain chat.
        "capabilities": {
            "tools": info.tool_format is not None,
            "tool_format": info.tool_format,
            "tool_choice_required": info.tool_format in TOOL_GRAMMAR_FORMATS,
            "structured_output": info.structured_output,
            "reasoning": info.reasoning,
        },
    }
