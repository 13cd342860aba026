"""uvicorn's HTTP/1.1 protocol with a deadline for request headers.

uvicorn closes idle keep-alive connections, but a connection that never
sends anything, or sends its headers a byte at a time (slowloris), is held
forever: every byte it sends cancels the keep-alive timer. Here a request's
headers must be complete within ``[limits] header_timeout`` seconds of the
connection opening or of the request's first byte; otherwise mlxd answers
408 and closes the connection. Bodies have their own deadline
(``[limits] body_timeout``, :mod:`mlxd.api.http.body`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

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


def make_protocol(header_timeout: Callable[[], float]) -> type[H11Protocol]:
    """An ``H11Protocol`` class whose header deadline is read live from ``header_timeout()``."""

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # Waiting for (the rest of) a request's headers.
                if self._header_timer is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
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
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a response is still being written (pipelining)
            logger.info("closing a connection that sent no complete request headers in time")
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

    return HeaderDeadlineProtocol
