"""The bridge from the engine thread to one request's coroutine.

The engine thread pushes events with ``loop.call_soon_threadsafe``; the
awaiting side reads them from an ``asyncio.Queue``. A loop that has closed
(the client went away and the server shut down) turns pushes into no-ops, so
the engine never blocks or raises on a reader that is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from mlxd.engine.messages import Accepted, Admitted, Event, Failed, Finished


class Channel:
    """One request's event queue, written by the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.reader_gone = False

    def push(self, event: Event) -> None:
        """Called on the engine thread."""
        if self.reader_gone:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed
            self.reader_gone = True

    async def get(self) -> Event:
        return await self._queue.get()

    def close(self, final: Event) -> None:
        """Called on the reader's loop: ignore the engine from now on, end with ``final``.

        Whoever still waits on this channel (a handler whose client left)
        gets ``final`` at once instead of waiting for an event the engine
        will no longer deliver.
        """
        self.reader_gone = True
        self._queue.put_nowait(final)


class RequestHandle:
    """What :meth:`Engine.submit` returns: the request's events, and a way to cancel it."""

    def __init__(self, request_id: str, channel: Channel, cancel: Callable[[str], None]):
        self.id = request_id
        self._channel = channel
        self._cancel = cancel
        self._done = False

    async def accepted(self) -> Accepted | Failed:
        """Wait for the engine to tokenize the request and pick its lane (or refuse it)."""
        event = await self._channel.get()
        assert isinstance(event, Accepted | Failed), event
        if isinstance(event, Failed):
            self._done = True
        return event

    async def admitted(self) -> Admitted | Failed:
        """After :meth:`accepted`: wait until the request leaves its queue (or fails there).

        :class:`Admitted` carries the prompt-cache lookup; a handler that
        does not call this sees it among :meth:`events` instead.
        """
        event = await self._channel.get()
        assert isinstance(event, Admitted | Failed), event
        if isinstance(event, Failed):
            self._done = True
        return event

    async def events(self) -> AsyncIterator[Event]:
        """The remaining events, ending with a :class:`Finished` or :class:`Failed`."""
        while not self._done:
            event = await self._channel.get()
            if isinstance(event, Finished | Failed):
                self._done = True
            yield event

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Stop generating for this request at the next token (idempotent).

        Call on the event loop that reads the handle. A reader still waiting
        for events gets a ``cancelled`` failure at once.
        """
        if not self._done and not self._channel.reader_gone:
            self._channel.close(Failed("cancelled", "the request was cancelled", 499))
            self._cancel(self.id)
