"""uvicorn's HTTP/1.1 protocol with a deadline for request headers and a lingering close.

uvicorn closes idle keep-alive connections, but a connection that never
sends anything, or sends its headers a byte at a time (slowloris), is held
forever: every byte it sends cancels the keep-alive timer. Here a request's
headers must be complete within ``[limits] header_timeout`` seconds of the
connection opening or of the request's first byte; otherwise mlxd answers
408 and closes the connection. Bodies have their own deadline
(``[limits] body_timeout``, :mod:`mlxd.api.http.guard`).

When mlxd answers early and closes (a 413 before reading the body, a 408, a
refusal with ``Connection: close``) the client may still be sending. Closing
a socket with unread bytes makes the kernel reset the connection, and the
client then sees a reset instead of the answer. So such a close lingers, as
web servers do: the answer is sent with a half-close (FIN), and what the
client still sends is read and dropped until it closes its side, goes quiet
for :data:`LINGER_IDLE` seconds, or :data:`LINGER_SECONDS` or
:data:`LINGER_BYTES` run out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\n"
    b"content-length: 43\r\n\r\n"
    b"The request headers did not arrive in time."
)
LINGER_SECONDS = 10.0
LINGER_IDLE = 2.0
LINGER_BYTES = 64 * 2**20


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: ``close`` lingers when it must,
    and a lingering connection counts as closing."""

    def __init__(
        self, transport: asyncio.Transport, close: Callable[[], None], lingering: Callable[[], bool]
    ):
        self._transport = transport
        self._close = close
        self._lingering = lingering

    def close(self) -> None:
        self._close()

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._lingering()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def make_protocol(header_timeout: Callable[[], float]) -> type[H11Protocol]:
    """An ``H11Protocol`` class whose header deadline is read live from ``header_timeout()``."""

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        _linger_deadline = 0.0
        _lingering = False
        _dropped = 0
        _raw: asyncio.Transport

        def connection_made(self, transport: asyncio.Transport) -> None:
            self._raw = transport
            wrapped = _LingeringTransport(
                transport, self._close_gracefully, lambda: self._lingering
            )
            super().connection_made(wrapped)  # pyright: ignore[reportArgumentType]
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                self._drop(len(data))
                return
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # Waiting for (the rest of) a request's headers.
                if self._header_timer is None:
                    self._arm()
            else:
                self._disarm()

        def eof_received(self) -> None:
            # Returning nothing closes the transport, as uvicorn's own does: once
            # lingering, the client is done sending and the answer got through.
            return

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_lingering_timer()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout(), self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self._raw.is_closing() or self._lingering or self.conn.their_state is not h11.IDLE:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a response is still being written (pipelining)
            logger.info("closing a connection that sent no complete request headers in time")
            self._raw.write(_TIMEOUT_RESPONSE)
            self._linger()

        # ------------------------------------------------------------ lingering close

        def _close_gracefully(self) -> None:
            """uvicorn's ``transport.close()``: linger while the client may still be sending."""
            if self._lingering or self._raw.is_closing():
                return
            if self.conn.their_state is h11.SEND_BODY:
                self._linger()
            else:
                self._raw.close()

        def _linger(self) -> None:
            self._disarm()
            self._lingering = True
            # uvicorn may have paused reading while the body went unread.
            self._raw.resume_reading()
            if self._raw.can_write_eof():
                self._raw.write_eof()  # the answer, then FIN
            self._linger_deadline = self.loop.time() + LINGER_SECONDS
            self._wait_linger()

        def _drop(self, size: int) -> None:
            self._dropped += size
            if self._dropped > LINGER_BYTES:
                self._raw.close()
                return
            self._wait_linger()

        def _wait_linger(self) -> None:
            self._stop_lingering_timer()
            left = self._linger_deadline - self.loop.time()
            self._linger_timer = self.loop.call_later(
                max(0.0, min(LINGER_IDLE, left)), self._raw.close
            )

        def _stop_lingering_timer(self) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None

    return HeaderDeadlineProtocol
