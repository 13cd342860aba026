"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Handlers are thin: read and validate the body, submit to the engine, wait for
it to accept (or refuse) the request, then answer with JSON or an SSE stream.
A client that goes away cancels its generation at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from litestar import Controller, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from litestar.response import Stream

from mlxd.api.http.body import read_body
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import note_of
from mlxd.api.openai.render import Kind, Renderer, sse_error
from mlxd.api.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    decode,
)
from mlxd.api.state import AppState, Mlxd, provide_app_state

if TYPE_CHECKING:
    from mlxd.engine import Lease
from mlxd.engine import (
    TOOL_GRAMMAR_FORMATS,
    Accepted,
    Delta,
    Failed,
    Finished,
    FleetRefusal,
    GenerationRequest,
    IntakeError,
    LaneDecision,
    ModelState,
    RequestHandle,
    check_request,
)

logger = logging.getLogger(__name__)


def key_accepted(headers: Any, keys: list[Any]) -> bool:
    """Whether ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` names one of ``keys``."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    given.append(headers.get("x-api-key", "").strip())
    for candidate in (g.encode() for g in given if g):
        if any(hmac.compare_digest(candidate, k.get_secret_value().encode()) for k in keys):
            return True
    return False


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """``/v1`` needs a key when ``[server] api_keys`` is set (Bearer, or Anthropic's x-api-key)."""
    keys = connection.app.state.mlxd.settings.server.api_keys
    if not keys or key_accepted(connection.headers, keys):
        return
    raise OpenAIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
        "(or 'x-api-key: <key>').",
        code="invalid_api_key",
    )


def check_accepting(state: AppState) -> None:
    if state.shutting_down:
        raise OpenAIError(
            503,
            "The server is shutting down; retry on another instance or later.",
            code="shutting_down",
        )


async def acquire(state: AppState, name: str | None, kind: str = "chat") -> Lease:
    """The model ``name`` (an id or alias) stands for, loaded and held for one request.

    Unknown names get 404 ``model_not_found`` listing the ids; a model of the
    other kind 400; a model that cannot load 503; one that can never fit in
    ``[memory] budget`` 400. Release the lease when the answer is sent.
    """
    try:
        return await state.fleet.acquire(name, kind)
    except FleetRefusal as exc:
        raise OpenAIError.from_failed(exc.failed) from None


@contextlib.asynccontextmanager
async def held(state: AppState, name: str | None, kind: str = "chat") -> AsyncIterator[Lease]:
    """:func:`acquire` for a request answered whole: released when the block ends."""
    lease = await acquire(state, name, kind)
    try:
        yield lease
    finally:
        lease.release()


@contextlib.contextmanager
def released_on_error(lease: Lease) -> Iterator[Lease]:
    """Hold ``lease`` past the block (``generate`` releases it), unless the block fails."""
    try:
        yield lease
    except BaseException:
        lease.release()
        raise


async def check_generation(
    state: AppState, lease: Lease, gen: GenerationRequest, *, json_param: str, tools_param: str
) -> None:
    """All that is checked before ``gen`` is queued: its values, then its grammar (400s)."""
    check_values(lease.info, gen)
    await warm_constraint(state, lease, gen, json_param=json_param, tools_param=tools_param)


def check_values(info: Any, gen: GenerationRequest) -> None:
    """Token ids and prompt size against the served model, before anything is queued."""
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


class Output(Protocol):
    """How one API renders a request's events: a whole response or SSE bytes.

    Chat completions, completions, Responses and Messages each have one; they
    all run through :func:`generate`, the one submit/accept/stream path.
    """

    def collect(self, delta: Delta) -> None: ...

    def response(self, finished: Finished) -> dict[str, Any]: ...

    def stream_start(self) -> list[bytes]: ...

    def stream_delta(self, delta: Delta) -> list[bytes]: ...

    def stream_end(self, finished: Finished) -> list[bytes]: ...

    def stream_error(self, failed: Failed) -> list[bytes]: ...


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


async def warm_constraint(
    state: AppState, lease: Lease, gen: GenerationRequest, *, json_param: str, tools_param: str
) -> None:
    """Compile a request's grammar before it is queued; a 400 when it cannot be."""
    if gen.constraint is None:
        return
    warmed = await lease.engine.warm_grammar(gen.constraint)
    if isinstance(warmed, tuple):
        for observe in state.compile_observers:
            observe(*warmed)
    elif warmed is not None:
        raise OpenAIError(
            400,
            f"The grammar cannot be compiled for this model: {warmed}",
            code="invalid_schema",
            param=json_param if gen.constraint.kind == "json" else tools_param,
        )


async def _sse(
    handle: RequestHandle, output: Output, done: Callable[[Any], None], lease: Lease
) -> AsyncIterator[bytes]:
    try:
        for chunk in output.stream_start():
            yield chunk
        async for event in handle.events():
            if isinstance(event, Delta):
                for chunk in output.stream_delta(event):
                    yield chunk
            elif isinstance(event, Finished):
                done(event)
                for chunk in output.stream_end(event):
                    yield chunk
            elif isinstance(event, Failed):
                done(event)
                for chunk in output.stream_error(event):
                    yield chunk
    finally:
        handle.cancel()  # a no-op once finished; stops generation if the client left
        lease.release()


async def generate(
    request: Request,
    state: AppState,
    lease: Lease,
    gen: GenerationRequest,
    make_output: Callable[[Accepted], Output],
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> Response[Any] | Stream:
    """Submit ``gen``, wait until the engine accepts it, then answer whole or as SSE.

    Every API goes through here: same lanes, admission, queue (429 with
    ``Retry-After``), stop handling, metrics observers and disconnect
    cancellation. A refusal or a failure raises :class:`OpenAIError`, which
    the app renders in the error shape of the route. ``lease`` is released
    when the answer is complete (a stream's last byte).
    """
    try:
        handle = lease.engine.submit(gen)
    except BaseException:
        lease.release()
        raise
    watcher = asyncio.create_task(_watch_disconnect(request, handle))
    try:
        accepted = await handle.accepted()
        if isinstance(accepted, Failed):
            raise OpenAIError.from_failed(accepted)
        output = make_output(accepted)
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
            body = _sse(handle, output, done, lease)
            # A stream the client left before its first byte is never iterated,
            # so its finally never runs: release the lease when it is collected.
            weakref.finalize(body, lease.release)
            return Stream(body, media_type="text/event-stream", headers=headers)
        async for event in handle.events():
            if isinstance(event, Delta):
                output.collect(event)
            elif isinstance(event, Finished):
                done(event)
                return Response(output.response(event), headers=headers)
            elif isinstance(event, Failed):
                done(event)
                raise OpenAIError.from_failed(event)
        raise OpenAIError(
            500, "the engine ended the request without an answer", code="internal_error"
        )
    except BaseException:
        handle.cancel()
        lease.release()
        raise
    finally:
        if not stream:
            watcher.cancel()
            lease.release()


class OpenAIController(Controller):
    path = "/v1"
    guards = [api_key_guard]
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}

    @get("/models")
    async def list_models(self, mlxd: Mlxd) -> dict[str, Any]:
        return {"object": "list", "data": [model_json(m) for m in mlxd.fleet.view().models]}

    @get("/models/{model_id:path}")
    async def get_model(self, mlxd: Mlxd, model_id: FromPath[str]) -> dict[str, Any]:
        model = mlxd.fleet.view().get(model_id.lstrip("/"))
        if model is None:
            ids = ", ".join(m.id for m in mlxd.fleet.view().models)
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


_KINDS: dict[Kind, tuple[type, Callable[..., GenerationRequest]]] = {
    "chat": (ChatRequest, chat_request),
    "completion": (CompletionRequest, completion_request),
}


async def _serve(request: Request, state: AppState, kind: Kind) -> Response[Any] | Stream:
    """Read, validate and run one completion request of either kind."""
    check_accepting(state)
    schema, build = _KINDS[kind]
    body = await read_body(request, state.settings.limits.max_body_bytes)
    ignored: list[str] | None = [] if state.settings.server.unknown_parameters == "ignore" else None
    req = decode(body, schema, ignored=ignored)
    note_of(request.scope).model = req.model
    headers = {}
    if ignored:
        logger.debug("%s: ignored unknown parameters %s", request.url.path, ignored)
        headers[IGNORED_HEADER] = ignored_header(ignored)
    lease = await acquire(state, req.model)
    with released_on_error(lease):
        gen = build(req, lease.settings, faults=state.fault_injection, info=lease.info)
        await check_generation(
            state, lease, gen, json_param="response_format", tools_param="tool_choice"
        )
    usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)

    def make_output(accepted: Accepted) -> Output:
        renderer = Renderer(
            kind,
            gen.id,
            accepted.model,
            logprobs=gen.logprobs,
            reasoning_field=state.settings.server.reasoning_field,
        )
        return ChatOutput(renderer, usage)

    return await generate(
        request, state, lease, gen, make_output, stream=req.stream, headers=headers
    )


IGNORED_HEADER = "X-Mlxd-Ignored-Parameters"
_HEADER_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def ignored_header(names: list[str], limit: int = 20) -> str:
    """The ignored names for a response header: safe characters only, at most ``limit``."""
    safe = sorted({n for n in names if _HEADER_SAFE.match(n)})
    shown = safe[:limit]
    rest = len(names) - len(shown)
    return ", ".join(shown + ([f"({rest} more)"] if rest else []))


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
        out["error"] = model.error
    if model.kind == "chat" and caps:
        out["context_length"] = caps.get("context_length")
        out["vocab_size"] = caps.get("vocab_size")
        out["max_token_chars"] = caps.get("max_token_chars")
        # What this model can do beyond plain chat (known once it has been loaded).
        out["capabilities"] = {
            "tools": tool_format is not None,
            "tool_format": tool_format,
            "tool_choice_required": tool_format in TOOL_GRAMMAR_FORMATS,
            "structured_output": caps.get("structured_output", False),
            "reasoning": caps.get("reasoning", False),
        }
    elif model.kind == "embedding" and caps:
        out["dimensions"] = caps.get("dimensions")
        out["context_length"] = caps.get("context_length")
        out["vocab_size"] = caps.get("vocab_size")
        # Whether a request's `dimensions` may shorten the vectors (Matryoshka models).
        out["supports_dimensions"] = caps.get("supports_dimensions", False)
    return out
