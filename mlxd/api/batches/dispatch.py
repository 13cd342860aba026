"""One batch line run through the app itself: the route, checks and envelope of a direct call.

A line is an in-process ASGI request to the Litestar app (inside the request
guard, whose limits the upload already applied): the route decodes and
validates the body, :func:`mlxd.api.generate.generate` submits it, the
route's error handlers shape any refusal. So a line's ``status_code`` and
``body`` are what the same request sent over HTTP would get, by
construction. The scope carries the line's
:class:`~mlxd.api.http.caller.Caller` (no client can put a key in an ASGI
scope): the API-key guard lets it pass (the batch's owner was checked when
the batch was created) and the line runs as its owner's key (its name, its
``models``; not its rate quotas: the lines run only in idle time), in the
``batch`` priority class.

Cancelling a line (its batch cancelled) is a client disconnect: the route
cancels the generation at its next token, as for a client that went away.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from mlxd.api.http.caller import CALLER_SCOPE_KEY, Caller


@dataclass(frozen=True)
class LineAnswer:
    status: int
    body: Any
    request_id: str | None


async def run_line(
    app: Any, url: str, body: dict[str, Any], caller: Caller, cancel: asyncio.Event
) -> LineAnswer:
    """POST ``body`` to ``url`` through ``app`` as ``caller``; the answer as a client reads it.

    ``caller`` names the line and the key that created the batch, as configured
    now (no key when ``/v1`` is open, or when the key is gone: then the guard
    answers the line with its 401).
    """
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": url,
        "raw_path": url.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
        "client": ("batch", 0),
        "server": ("localhost", 0),
        "state": {},
        CALLER_SCOPE_KEY: caller,
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await cancel.wait()
        return {"type": "http.disconnect"}

    status = 500
    headers: dict[bytes, bytes] = {}
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = {k.lower(): v for k, v in message.get("headers", ())}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    raw = b"".join(chunks)
    try:
        answer: Any = json.loads(raw) if raw else None
    except ValueError:
        answer = raw.decode("utf-8", "replace")
    request_id = headers.get(b"x-request-id")
    return LineAnswer(status, answer, request_id.decode() if request_id else None)
