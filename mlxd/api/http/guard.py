"""Checks that run on every HTTP request before routing (and so before authentication).

:class:`RequestGuard` wraps the whole ASGI app (so unknown routes are covered
too) and refuses:

- a ``Host`` that is not on the allow-list (:func:`mlxd.api.http.access.host_allowed`)
  with 421 Misdirected Request: this is what stops DNS rebinding, where a web
  page on an attacker's name that resolves to this machine talks to mlxd with
  the visitor's browser;
- a body sent to ``/v1`` without a JSON ``Content-Type`` with 415 (but for the
  Batch API's multipart file upload, ``POST /v1/files``, read by its route
  under ``[batches]`` limits instead of here, and a bodyless
  ``POST /v1/batches/{id}/cancel``): browsers
  send ``text/plain``, form and multipart bodies (and bodies with no type)
  cross-site without a CORS preflight, and a JSON API has no use for them;
- a body that declares more than ``[limits] max_body_bytes`` with 413, on
  every route; outside ``/v1`` (the dashboard's forms) a body must declare
  its length (411 otherwise).

Then it reads every request's body itself, whatever the route, under the
same limits: more than ``max_body_bytes`` is a 413 as soon as it is known,
and a body that has not arrived in full within ``[limits] body_timeout``
seconds is a 408. Only then does the app see the request, with the body
replayed: no handler, form parser or middleware (Litestar's CSRF check reads
forms) can wait on a client that stops sending, authenticated or not.

These answers come before routing, so no router's error handlers apply: each
is written in the envelope :class:`~mlxd.api.http.errors.Envelopes` picks for
the request's path (the API the request was meant for), and each closes the
connection (``Connection: close``; the unread rest of a body is drained by
:mod:`mlxd.api.http.protocol` so the client reads the answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from mlxd.api.http.access import host_allowed
from mlxd.api.http.errors import Envelopes
from mlxd.config import Settings, format_bytes
from mlxd.logs import safe

logger = logging.getLogger(__name__)

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json_type(content_type: str) -> bool:
    """``application/json`` or any ``+json`` type, with or without parameters."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestGuard:
    """ASGI middleware: Host allow-list everywhere, JSON bodies on ``/v1``.

    Args:
        app: The Litestar app.
        settings: Called per request for the live settings (``allowed_hosts``
            reloads live).
        envelopes: The error envelope of each API, by path.
    """

    def __init__(self, app: Any, settings: Callable[[], Settings], envelopes: Envelopes):
        self.app = app
        self._settings = settings
        self._envelopes = envelopes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        host = _header(scope, b"host")
        # HTTP/1.1 requires Host (h11 refuses requests without one); an
        # HTTP/1.0 client without it is no browser, so nothing to rebind.
        settings = self._settings()
        if host is not None and not host_allowed(host, settings):
            logger.warning("refused a request for Host %s on %s", safe(host), safe(path))
            await self._answer(
                send,
                path,
                421,
                f"Host {host!r} is not served here. Reach mlxd by IP address, localhost or "
                "this machine's name, or add the name to [server] allowed_hosts.",
                "host_not_allowed",
            )
            return
        limits = settings.limits
        refusal = None
        body_limit = limits.max_body_bytes
        if _is_upload(scope, path):
            # POST /v1/files: a multipart file, read by its route under [batches]
            # max_file_bytes and upload_timeout, streamed to disk (mlxd.api.batches.upload).
            refusal = _upload_refusal(scope, settings.batches.max_file_bytes)
            if refusal is None:
                await self.app(scope, receive, send)
                return
        elif _is_audio(scope, path):
            # POST /v1/audio/transcriptions|translations: a multipart audio file, read
            # here under [limits] audio_bytes (plus the form's own bytes), parsed by its route.
            body_limit = audio_body_limit(limits.audio_bytes)
            refusal = _upload_refusal(scope, body_limit, "limits.audio_bytes")
        elif scope.get("method") in _BODY_METHODS:
            refusal = _body_refusal(scope, path, limits.max_body_bytes)
        if refusal is None and _has_body(scope):
            body, refusal = await _read(receive, body_limit, limits.body_timeout)
            if body is None and refusal is None:
                return  # the client went away
            if body is not None:
                receive = _replay(body, receive)
        if refusal is not None:
            logger.info("refused a request on %s: %d %s", safe(path), refusal[0], refusal[2])
            await self._answer(send, path, *refusal)
            return
        await self.app(scope, receive, send)

    async def _answer(self, send: Any, path: str, status: int, message: str, code: str) -> None:
        body = self._envelopes.at(path).body(status, message, code=code)
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})


def _body_refusal(scope: dict[str, Any], path: str, limit: int) -> tuple[int, str, str] | None:
    """Why a request's body is refused before routing, or None."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        return (
            413,
            f"The request body is {format_bytes(int(declared))}; this server accepts at most "
            f"{format_bytes(limit)} ([limits] max_body_bytes).",
            "request_too_large",
        )
    if path == "/v1" or path.startswith("/v1/"):
        content_type = _header(scope, b"content-type") or ""
        if not is_json_type(content_type) and not _bodyless_action(scope, path):
            return (
                415,
                f"Content-Type must be application/json (got {content_type or 'none'}).",
                "unsupported_media_type",
            )
    elif declared is None and _header(scope, b"transfer-encoding") is not None:
        return 411, "A request body outside /v1 must declare its Content-Length.", "length_required"
    return None


# The one route whose body is neither JSON nor read here: the Batch API's file upload.
UPLOAD_PATHS = frozenset({"/v1/files", "/v1/files/"})


def _is_upload(scope: dict[str, Any], path: str) -> bool:
    if scope.get("method") != "POST" or path not in UPLOAD_PATHS:
        return False
    content_type = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
    return content_type == "multipart/form-data"


# Speech-to-text uploads (mlxd.api.openai.audio): multipart, read here under their own limit.
AUDIO_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})


def audio_body_limit(audio_bytes: int) -> int:
    """The largest audio upload body: the file's limit and 64 KiB for the form's fields."""
    return audio_bytes + 65_536


def _is_audio(scope: dict[str, Any], path: str) -> bool:
    if scope.get("method") != "POST" or path.rstrip("/") not in AUDIO_PATHS:
        return False
    content_type = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
    return content_type == "multipart/form-data"


def _upload_refusal(
    scope: dict[str, Any], limit: int, key: str = "batches.max_file_bytes"
) -> tuple[int, str, str] | None:
    # A browser may send a multipart form cross-site without a preflight: a web page
    # must not upload to this daemon, so an upload from another origin is refused.
    origin = _header(scope, b"origin")
    if origin is not None and origin.partition("://")[2] != (_header(scope, b"host") or ""):
        return 403, "A file upload from another web origin is refused.", "cross_origin_upload"
    declared = _header(scope, b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        return (
            413,
            f"The upload is {int(declared)} bytes; this server accepts files of at most "
            f"{limit} bytes ({key}).",
            "file_too_large",
        )
    return None


def _bodyless_action(scope: dict[str, Any], path: str) -> bool:
    """A POST that takes no body (``/v1/batches/{id}/cancel``) sent without one, as curl does."""
    return path.startswith("/v1/batches/") and path.endswith("/cancel") and not _has_body(scope)


def _has_body(scope: dict[str, Any]) -> bool:
    declared = _header(scope, b"content-length")
    if declared is not None:
        return declared.strip() != "0"
    return _header(scope, b"transfer-encoding") is not None


async def _read(
    receive: Any, limit: int, timeout: float
) -> tuple[bytes | None, tuple[int, str, str] | None]:
    """The whole body, or why not (413, 408); ``(None, None)`` when the client left."""
    chunks: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
        except TimeoutError:
            return None, (
                408,
                f"The request body did not arrive within {timeout:g} s "
                f"({size} bytes received; limits.body_timeout).",
                "request_timeout",
            )
        if message["type"] != "http.request":
            return None, None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None, (
                413,
                f"The request body is {format_bytes(size)} or more; this server accepts at "
                f"most {format_bytes(limit)} ([limits] max_body_bytes).",
                "request_too_large",
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(body: bytes, receive: Any) -> Any:
    """``receive`` for the app: the body read, in one message, then the connection's own."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
