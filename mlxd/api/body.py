"""Reading request bodies under the live ``limits.max_body_bytes``."""

from __future__ import annotations

from litestar import Request

from mlxd.api.errors import OpenAIError


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``limit``."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body is {size} bytes or more; this server accepts at most {limit} "
        "bytes (limits.max_body_bytes).",
        code="request_too_large",
    )
