"""The one generation path every API shares: route, check, submit, accept, answer or stream.

Chat completions, completions, Responses and Messages differ only in how they
read a body and how they render events (their :class:`Output`). Everything
between is here: the fleet lends the model (:func:`acquire`), the request's
values and grammar are checked before anything is queued
(:func:`check_generation`), :func:`generate` submits it, waits until the
engine accepts or refuses it, then answers whole or as SSE, and a client that
goes away cancels its generation at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from litestar import Request, Response
from litestar.response import Stream

from mlxd.api.grammar import prepare_off_loop
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import note_of
from mlxd.api.image_fetch import fetch_images
from mlxd.api.lookup import PROMPT_CACHE_HEADER, PROMPT_RULES_HEADER, header_value
from mlxd.api.prompt_rules import apply_prompt_rules
from mlxd.api.state import AppState
from mlxd.engine import (
    Accepted,
    CacheLookup,
    Delta,
    Failed,
    Finished,
    FleetRefusal,
    GenerationRequest,
    IntakeError,
    LaneDecision,
    ModelInfo,
    RequestHandle,
    check_request,
)

if TYPE_CHECKING:
    from mlxd.engine import Lease


def check_accepting(state: AppState) -> None:
    """503 ``shutting_down`` once a graceful shutdown has begun."""
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


def check_values(info: ModelInfo | None, gen: GenerationRequest) -> None:
    """Token ids and prompt size against the served model, before anything is queued."""
    if info is None:
        return
    try:
        check_request(gen, info)
    except IntakeError as exc:
        param = prompt_param(gen, exc.param)
        raise OpenAIError(400, str(exc), code=exc.code, param=param) from None


async def warm_constraint(
    state: AppState, lease: Lease, gen: GenerationRequest, *, json_param: str, tools_param: str
) -> None:
    """Check and compile a request's grammar off the event loop before it is queued (400s)."""
    constraint = gen.constraint
    if constraint is None:
        return
    warmed = await prepare_off_loop(
        lease.engine,
        constraint,
        param=json_param if constraint.kind == "json" else tools_param,
        budget=state.settings.limits.grammar_timeout,
    )
    if warmed is not None:
        for observe in state.compile_observers:
            observe(*warmed)


# What each API calls the prompt, where the engine says "messages" (chat's name).
_PROMPT_PARAMS = {"responses": "input"}


def prompt_param(gen: GenerationRequest, param: str | None) -> str | None:
    """The engine's ``param`` as ``gen``'s API names it (the prompt is ``input`` in Responses)."""
    if param == "messages":
        return _PROMPT_PARAMS.get(gen.api, param)
    return param


def refusal(gen: GenerationRequest, failed: Failed) -> OpenAIError:
    """The engine's refusal or failure of ``gen`` as an error of its API."""
    err = OpenAIError.from_failed(failed)
    err.param = prompt_param(gen, err.param)
    return err


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


async def _watch_disconnect(request: Request, handle: RequestHandle) -> None:
    """Cancel ``handle`` when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def _sse(
    handle: RequestHandle,
    output: Output,
    done: Callable[[Finished | Failed], None],
    lease: Lease,
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
    make_output: Callable[[Accepted, CacheLookup], Output],
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> Response[Any] | Stream:
    """Submit ``gen``, wait until the engine admits it, then answer whole or as SSE.

    Every API goes through here: same lanes, admission, queue (429 with
    ``Retry-After``), stop handling, metrics observers and disconnect
    cancellation. A refusal or a failure raises :class:`OpenAIError`, which
    the route's router renders in its API's error envelope. ``lease`` is
    released when the answer is complete (a stream's last byte).

    The response starts once the request has left the queue, when its
    prompt-cache lookup is known: every answer, streamed or not, carries
    ``X-Mlxd-Prompt-Cache`` (docs/api.md), and a request that fails while it
    waits gets its error status, not an SSE error after a 200.
    """
    try:
        gen = await fetch_images(gen, lease.settings)  # remote images, when fetch_images is on
        gen = apply_prompt_rules(gen, lease.settings.prompt_cache.volatile_rules)
        handle = lease.engine.submit(gen)
    except BaseException:
        lease.release()
        raise
    watcher = asyncio.create_task(_watch_disconnect(request, handle))
    try:
        accepted = await handle.accepted()
        if isinstance(accepted, Failed):
            raise refusal(gen, accepted)
        note = note_of(request.scope)
        note.accepted(accepted, gen.prompt_rules)
        admitted = await handle.admitted()
        if isinstance(admitted, Failed):
            note.ended(admitted)
            state.observe(accepted, admitted)
            raise refusal(gen, admitted)
        lookup = admitted.lookup
        note.admitted(lookup)
        output = make_output(accepted, lookup)
        headers = {
            **(headers or {}),
            "X-Mlxd-Lane": LaneDecision(accepted.lane, accepted.reason).header,
            "X-Request-Id": gen.id,
            PROMPT_CACHE_HEADER: header_value(lookup),
        }
        if gen.prompt_rules:
            headers[PROMPT_RULES_HEADER] = ",".join(gen.prompt_rules)

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
                raise refusal(gen, event)
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
