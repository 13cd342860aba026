"""Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"}}``.

Same status codes as everywhere else; the ``type`` names Anthropic's error
classes, so its SDKs raise their typed exceptions.
"""

from __future__ import annotations

from typing import Any

from mlxd.api.http.errors import Envelope

_TYPES = {
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


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's envelope: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _anthropic(status: int, message: str, code: str | None, param: str | None) -> dict[str, Any]:
    return anthropic_error_body(status, message)  # Anthropic's errors carry no code or param


ANTHROPIC = Envelope("anthropic", _anthropic)
