"""How an admitted request is answered: whole, or as SSE with keep-alives.

:func:`mlxd.api.generate.generate` submits a request and waits until the
engine admits it; then :func:`whole` collects its events into one response,
or :func:`streamed` sends them as they come. Each API renders the events
through its :class:`Output`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from litestar import Response
from litestar.response import Stream

from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import Note
from mlxd.engine import Delta, Failed, Finished, RequestHandle, ToolCall, ToolCallPart

if TYPE_CHECKING:
    from mlxd.engine import Lease

# Called once with how the request ended: quotas, the request log, the metrics.
Done = Callable[[Finished | Failed], None]


class Output(Protocol):
    """How one API renders a request's events: a whole response or SSE bytes.

    Chat completions, completions, Responses and Messages each have one; they
    all run through :func:`mlxd.api.generate.generate`, the one
    submit/accept/stream path.
    """

    def collect(self, delta: Delta) -> None: ...

    def response(self, finished: Finished) -> dict[str, Any]: ...

    def stream_start(self) -> list[bytes]: ...

    def stream_delta(self, delta: Delta) -> list[bytes]: ...

    def stream_end(self, finished: Finished) -> list[bytes]: ...

    def stream_error(self, failed: Failed) -> list[bytes]: ...

    def stream_keepalive(self) -> list[bytes]: ...


def call_events(delta: Delta) -> list[ToolCallPart | ToolCall]:
    """A delta's call parts and finished calls as they happened, for a streamed renderer:
    by call index, each call's parts (in order) before the call itself."""
    return sorted([*delta.tool_call_parts, *delta.tool_calls], key=lambda e: e.index)


async def whole(
    handle: RequestHandle,
    output: Output,
    done: Done,
    refuse: Callable[[Failed], OpenAIError],
    headers: dict[str, str],
) -> Response[Any]:
    """The request's answer in one response; a failure raises ``refuse(failed)``."""
    async for event in handle.events():
        if isinstance(event, Delta):
            output.collect(event)
        elif isinstance(event, Finished):
            done(event)
            return Response(output.response(event), headers=headers)
        elif isinstance(event, Failed):
            done(event)
            raise refuse(event)
    raise OpenAIError(500, "the engine ended the request without an answer", code="internal_error")


def streamed(
    handle: RequestHandle,
    output: Output,
    done: Done,
    lease: Lease,
    note: Note,
    *,
    keepalive: float,
    headers: dict[str, str],
) -> Stream:
    """The request's events as SSE; ``lease`` is released after the last byte.

    The stream listens for a disconnect itself: a client that leaves cancels
    the generation at its next token.
    """
    headers["Cache-Control"] = "no-cache"
    body = _sse(handle, output, done, lease, keepalive, note)
    # A stream the client left before its first byte is never iterated,
    # so its finally never runs: release the lease when it is collected.
    weakref.finalize(body, lease.release)
    return Stream(body, media_type="text/event-stream", headers=headers)


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


async def _sse(
    handle: RequestHandle,
    output: Output,
    done: Done,
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
