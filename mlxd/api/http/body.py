"""Reading request bodies under the live ``[limits]``: size and time.

A body larger than ``max_body_bytes`` (or a route's own, smaller limit) is
refused with 413 as soon as that is known; a body that has not arrived in
full within ``body_timeout`` seconds (a client that stalls, or declares more
bytes than it sends) gets 408. Both close the connection. The request guard
(:mod:`mlxd.api.http.guard`) has already read every body under the same
limits before routing, so here the body is usually there at once; a route
keeps this call for its own smaller limit.
"""

from __future__ import annotations

import asyncio
import time

from litestar import Request

from mlxd.api.http.errors import OpenAIError
from mlxd.config import format_bytes


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, or a 413/408 as soon as it is too large or too late.

    Args:
        request: The request whose body to read.
        limit: Largest body in bytes.
        timeout: Seconds the whole body may take; default ``[limits] body_timeout``.
    """
    if timeout is None:
        timeout = float(request.app.state.mlxd.settings.limits.body_timeout)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout
    stream = request.stream().__aiter__()
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            chunk = await asyncio.wait_for(stream.__anext__(), left)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise OpenAIError(
                408,
                f"The request body did not arrive within {timeout:g} s "
                f"({size} bytes received; limits.body_timeout).",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body is {format_bytes(size)} or more; this server accepts at most "
        f"{format_bytes(limit)} ([limits] max_body_bytes).",
        code="request_too_large",
        # The rest of the body may still be on its way: this connection is done.
        headers={"Connection": "close"},
    )
