"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Under ``/v1/messages`` (the Anthropic Messages API) the same errors are
answered in Anthropic's envelope instead:
``{"type": "error", "error": {"type", "message"}}``, same status codes.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException

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


class OpenAIError(Exception):
    """An error answered in the OpenAI shape with its HTTP status."""

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
        headers = {"Retry-After": str(failed.retry_after)} if failed.retry_after else None
        return cls(
            failed.status, failed.message, code=failed.code, param=failed.param, headers=headers
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict:
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


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's envelope: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    """Routes of the Anthropic Messages API answer errors in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body_for_path(
    path: str, status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict:
    """The error body in the shape of the API that ``path`` belongs to."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, code=code, param=param)


def _shaped(request: Request, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (OpenAI's shape) in the shape of the API the request's route belongs to."""
    if is_anthropic_path(request.url.path):
        return anthropic_error_body(status, body["error"]["message"])
    return body


def openai_error_handler(request: Request, exc: OpenAIError) -> Response:
    return Response(
        _shaped(request, exc.status, exc.body()),
        status_code=exc.status,
        headers=exc.headers,
        media_type=MediaType.JSON,
    )


def http_error_handler(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (unknown route, wrong method) in the OpenAI shape."""
    status = exc.status_code
    if status == 404:
        message = f"Unknown route: {request.method} {request.url.path}"
        code = "unknown_route"
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    headers = dict(exc.headers or {})
    body = _shaped(request, status, error_body(status, message, code=code))
    return Response(body, status_code=status, headers=headers)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    body = error_body(
        500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error"
    )
    return Response(_shaped(request, 500, body), status_code=500)
