"""API keys on ``/v1``: ``Authorization: Bearer <key>`` or Anthropic's ``x-api-key``."""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from pydantic import SecretStr

from mlxd.api.http.errors import OpenAIError


def key_accepted(headers: Mapping[str, str], keys: Sequence[SecretStr]) -> bool:
    """Whether ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` names one of ``keys``."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    given.append(headers.get("x-api-key", "").strip())
    for candidate in (g.encode() for g in given if g):
        if any(hmac.compare_digest(candidate, k.get_secret_value().encode()) for k in keys):
            return True
    return False


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """``/v1`` needs a key when ``[server] api_keys`` is set (Bearer, or Anthropic's x-api-key)."""
    keys = connection.app.state.mlxd.settings.server.api_keys
    if not keys or key_accepted(connection.headers, keys):
        return
    raise OpenAIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
        "(or 'x-api-key: <key>').",
        code="invalid_api_key",
    )
