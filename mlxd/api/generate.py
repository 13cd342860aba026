"""The one generation path every API shares: route, check, submit, accept, answer or stream.

Chat completions, completions, Responses and Messages differ only in how they
read a body and how they render events (their :class:`Output`). Everything
between is here: the fleet lends the model (:func:`mlxd.api.lease.acquire`), the request's
values and grammar are checked before anything is queued
(:func:`check_generation`), :func:`generate` submits it, waits until the
engine accepts or refuses it, then answers whole or as SSE, and a client that
goes away cancels its generation at the next token.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from litestar import Request, Response
from litestar.response import Stream

from mlxd.api.batches.dispatch import batch_mark
from mlxd.api.forced_tool import force_tool_call
from mlxd.api.grammar import prepare_off_loop
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.keys import who_of
from mlxd.api.http.requestlog import Note, note_of
from mlxd.api.image_fetch import fetch_images
from mlxd.api.lease import is_anthropic
from mlxd.api.lookup import PROMPT_CACHE_HEADER, PROMPT_RULES_HEADER, header_value
from mlxd.api.priority import effective as effective_priority
from mlxd.api.prompt_rules import apply_prompt_rules
from mlxd.api.state import AppState
from mlxd.engine import (
    Accepted,
    CacheLookup,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    IntakeError,
    LaneDecision,
    ModelInfo,
    RequestHandle,
    check_request,
)

if TYPE_CHECKING:
    from mlxd.engine import Lease

# The number of tools left out of a request to a model that cannot call tools.
TOOLS_IGNORED_HEADER = "X-Mlxd-Tools-Ignored"


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
        err = OpenAIError(400, str(exc), code=exc.code, param=param)
        raise worded(gen, err, info) from None


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


_TOO_LONG = re.compile(
    r"maximum context length is (\d+) tokens\. However, your prompt is (\d+) (tokens|characters)"
)


def worded(gen: GenerationRequest, err: OpenAIError, info: ModelInfo | None) -> OpenAIError:
    """``err`` in the words its API's clients parse.

    Claude Code compacts its conversation only on Anthropic's own wording of
    a context overflow, ``prompt is too long: N tokens > M maximum`` (M: the
    longest prompt that leaves room for one token).
    """
    if gen.api != "messages" or err.code != "context_length_exceeded":
        return err
    found = _TOO_LONG.search(err.message)
    if found is None:
        return err
    ctx, size, unit = int(found[1]), int(found[2]), found[3]
    if unit == "characters":  # refused before tokenizing: at least this many tokens
        per_token = info.max_token_chars if info is not None and info.max_token_chars else 1
        size = max(ctx, -(-size // per_token))
    err.message = f"prompt is too long: {size} tokens > {ctx - 1} maximum"
    return err


def refusal(gen: GenerationRequest, failed: Failed, info: ModelInfo | None = None) -> OpenAIError:
    """The engine's refusal or failure of ``gen`` as an error of its API."""
    err = OpenAIError.from_failed(failed)
    err.param = prompt_param(gen, err.param)
    return worded(gen, err, info)


def _short_of_room(accepted: Accepted | Failed) -> bool:
    return isinstance(accepted, Failed) and accepted.code == "context_over_budget"


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

    def stream_keepalive(self) -> list[bytes]: ...


async def _events_or_keepalive(
    handle: RequestHandle, every: float
) -> AsyncIterator[Delta | Finished | Failed | None]:
    """``handle``'s events, and None each time ``every`` seconds pass without one.

    A long prefill sends nothing for minutes; clients and proxies with an idle
    timer drop such a stream, so the caller sends a keep-alive on each None.
    The pending read is kept across keep-alives (never cancelled mid-event).
    """
    events = aiter(handle.events())
    pending: asyncio.Task[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=every if every > 0 else None)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()


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
    keepalive: float,
    note: Note,
) -> AsyncIterator[bytes]:
    generated = 0
    ended = False
    try:
        for chunk in output.stream_start():
            yield chunk
        async for event in _events_or_keepalive(handle, keepalive):
            if event is None:
                for chunk in output.stream_keepalive():
                    yield chunk
            elif isinstance(event, Delta):
                generated += len(event.token_ids)
                for chunk in output.stream_delta(event):
                    yield chunk
            elif isinstance(event, Finished):
                ended = True
                done(event)
                for chunk in output.stream_end(event):
                    yield chunk
            elif isinstance(event, Failed):
                ended = True
                done(event)
                for chunk in output.stream_error(event):
                    yield chunk
    finally:
        if not ended:  # the client left mid-stream: logged as cancelled, with what it got
            note.cancelled(generated)
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
    asked: str | None = None,
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

    The request runs as its API key (``client``) at the priority class it
    ``asked`` for, never above its key's (:mod:`mlxd.api.priority`); its
    tokens count against the key's ``tokens_per_minute`` when it ends.
    """
    who = who_of(request.scope)
    # A Batch API line runs as its owner's key in the idle-time class, outside the
    # key's quotas (docs/batches.md).
    batch_line = batch_mark(request.scope) is not None
    try:
        gen = replace(
            gen,
            client=who.name if who is not None else None,
            priority="batch" if batch_line else effective_priority(gen.priority, who, asked),
        )
        if who is not None or gen.priority != "normal":  # without keys the line stays as it was
            note_of(request.scope).priority = gen.priority
        gen = await fetch_images(gen, lease.settings)  # remote images, when fetch_images is on
        gen = apply_prompt_rules(gen, lease.settings.prompt_cache.volatile_rules)
        forced = force_tool_call(gen, lease.info, enabled=state.fault_injection)
        if forced is not gen:  # test-only (MLXD_FORCE_TOOL_CALL): compile its grammar
            await warm_constraint(state, lease, forced, json_param="", tools_param="tool_choice")
            gen = forced
        handle = lease.engine.submit(gen)
    except BaseException:
        lease.release()
        raise
    watcher = asyncio.create_task(_watch_disconnect(request, handle))
    try:
        accepted = await handle.accepted()
        # Short of KV room because other models' reservations fill [memory] budget:
        # the fleet unloads an idle one and the request is tried again (docs/batching.md).
        while _short_of_room(accepted) and await state.fleet.make_kv_room(lease.id):
            watcher.cancel()
            handle = lease.engine.submit(gen)
            watcher = asyncio.create_task(_watch_disconnect(request, handle))
            accepted = await handle.accepted()
        if isinstance(accepted, Failed):
            raise refusal(gen, accepted, lease.info)
        note = note_of(request.scope)
        note.accepted(accepted, gen.prompt_rules)
        note.tools_ignored = gen.tools_ignored or None
        admitted = await handle.admitted()
        if isinstance(admitted, Failed):
            note.ended(admitted)
            state.observe(accepted, admitted)
            raise refusal(gen, admitted, lease.info)
        lookup = admitted.lookup
        note.admitted(lookup)
        output = make_output(accepted, lookup)
        headers = {
            **(headers or {}),
            **state.quotas.headers(who, anthropic=is_anthropic(request)),
            "X-Mlxd-Lane": LaneDecision(accepted.lane, accepted.reason).header,
            "X-Request-Id": gen.id,
            PROMPT_CACHE_HEADER: header_value(lookup),
        }
        if gen.prompt_rules:
            headers[PROMPT_RULES_HEADER] = ",".join(gen.prompt_rules)
        if gen.tools_ignored:
            headers[TOOLS_IGNORED_HEADER] = str(gen.tools_ignored)

        def done(outcome: Finished | Failed) -> None:
            if isinstance(outcome, Finished) and not batch_line:
                usage = outcome.usage
                state.quotas.spend(who, usage.prompt_tokens + usage.completion_tokens)
            note.ended(outcome)
            state.observe(accepted, outcome)

        if stream:
            watcher.cancel()  # the streaming response listens for disconnects itself
            headers["Cache-Control"] = "no-cache"
            body = _sse(handle, output, done, lease, state.settings.server.stream_keepalive, note)
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
                raise refusal(gen, event, lease.info)
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
