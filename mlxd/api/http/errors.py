"""mlxd's error value, the envelopes APIs write it in, and one set of handlers per router.

Every refusal is raised as :class:`OpenAIError` (status, message, code,
param). An :class:`Envelope` writes it the way one API's clients expect:
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (:data:`OPENAI`,
the default), or Anthropic's (:mod:`mlxd.api.anthropic.errors`). A router
gets the handlers of its API's envelope (:func:`error_handlers`).

Litestar resolves a router's handlers only once a request is routed, so a
request that reaches no route (404, 405) and one the request guard refuses
before routing (:mod:`mlxd.api.http.guard`) have no router to ask: for those,
:class:`Envelopes` picks the envelope of the API whose path holds the request,
the same longest-prefix rule routing itself follows.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from mlxd.api.http.requestlog import note_of
from mlxd.engine import Failed

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    408: "invalid_request_error",
    411: "invalid_request_error",
    415: "invalid_request_error",
    421: "permission_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


# Refusals whose message may quote the server's files (a model that failed to
# load says where it looked): clients read them without paths; /stats, the
# dashboard and the log keep them for the operator.
PATH_HIDDEN = frozenset({"model_load_failed", "model_not_loaded"})
_PATH = re.compile(r"(?<![\w.:/~-])~?/[^\s'\"`:,;()\[\]{}<>/]+(?:/[^\s'\"`:,;()\[\]{}<>/]*)+")


def without_paths(text: str) -> str:
    """``text`` with absolute (and ``~``) file system paths of two or more parts as ``<path>``."""
    return _PATH.sub("<path>", text)


class OpenAIError(Exception):
    """A refusal with its HTTP status; answered in the envelope of the route's API."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def from_failed(cls, failed: Failed) -> OpenAIError:
        """The engine's or the fleet's refusal, as a client reads it (no server paths)."""
        headers = {"Retry-After": str(failed.retry_after)} if failed.retry_after else None
        message = failed.message
        if failed.code in PATH_HIDDEN:
            message = without_paths(message)
        return cls(failed.status, message, code=failed.code, param=failed.param, headers=headers)

    def body(self) -> dict[str, Any]:
        """The error in OpenAI's envelope (what an OpenAI stream's error event carries)."""
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }


# How an API writes (status, message, code, param) as an error body.
BodyWriter = Callable[[int, str, str | None, str | None], dict[str, Any]]


@dataclass(frozen=True)
class Envelope:
    """One API's error body shape."""

    name: str
    write: BodyWriter

    def body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> dict[str, Any]:
        return self.write(status, message, code, param)


def _openai(status: int, message: str, code: str | None, param: str | None) -> dict[str, Any]:
    return error_body(status, message, code=code, param=param)


OPENAI = Envelope("openai", _openai)


@dataclass(frozen=True)
class Envelopes:
    """The envelope of each API by the path its router is mounted at; ``default`` elsewhere."""

    default: Envelope
    by_path: Mapping[str, Envelope] = field(default_factory=dict)

    def at(self, path: str) -> Envelope:
        """The envelope of the API whose path is the longest one holding ``path``."""
        held = [p for p in self.by_path if path == p or path.startswith(p.rstrip("/") + "/")]
        return self.by_path[max(held, key=len)] if held else self.default


def error_handlers(envelope: Envelope | Envelopes) -> ExceptionHandlersMap:
    """A router's exception handlers: refusals, Litestar's own HTTP errors and crashes,
    all in ``envelope`` (or, at the app, in the envelope :class:`Envelopes` picks)."""

    def shape(request: Request) -> Envelope:
        return envelope.at(request.url.path) if isinstance(envelope, Envelopes) else envelope

    def refused(request: Request, exc: OpenAIError) -> Response[Any]:
        note_of(request.scope).refused(exc.code)
        body = shape(request).body(exc.status, exc.message, code=exc.code, param=exc.param)
        return Response(
            body, status_code=exc.status, headers=exc.headers, media_type=MediaType.JSON
        )

    def http_error(request: Request, exc: HTTPException) -> Response[Any]:
        """Litestar's own errors (unknown route, wrong method)."""
        status = exc.status_code
        if status == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
            code = "unknown_route"
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        note_of(request.scope).refused(code)
        body = shape(request).body(status, message, code=code)
        return Response(body, status_code=status, headers=dict(exc.headers or {}))

    def crashed(request: Request, exc: Exception) -> Response[Any]:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        note_of(request.scope).refused("internal_error")
        message = f"internal server error: {type(exc).__name__}: {exc}"
        return Response(shape(request).body(500, message, code="internal_error"), status_code=500)

    return {OpenAIError: refused, HTTPException: http_error, Exception: crashed}
