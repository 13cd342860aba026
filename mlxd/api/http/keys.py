"""API keys on ``/v1``: ``Authorization: Bearer <key>`` or Anthropic's ``x-api-key``."""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from pydantic import SecretStr

from mlxd.api.batches.dispatch import batch_mark
from mlxd.api.http.errors import OpenAIError


def presented_key(headers: Mapping[str, str], keys: Sequence[SecretStr]) -> str | None:
    """The one of ``keys`` that ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
    names, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    given.append(headers.get("x-api-key", "").strip())
    for candidate in (g.encode() for g in given if g):
        for key in keys:
            secret = key.get_secret_value()
            if hmac.compare_digest(candidate, secret.encode()):
                return secret
    return None


def key_accepted(headers: Mapping[str, str], keys: Sequence[SecretStr]) -> bool:
    """Whether ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` names one of ``keys``."""
    return presented_key(headers, keys) is not None


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """``/v1`` needs a key when ``[server] api_keys`` is set (Bearer, or Anthropic's x-api-key)."""
    keys = connection.app.state.mlxd.settings.server.api_keys
    if not keys or key_accepted(connection.headers, keys):
        return
    if batch_mark(connection.scope) is not None:
        return  # a Batch API line, run in process for the key that created its batch
    raise OpenAIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
        "(or 'x-api-key: <key>').",
        code="invalid_api_key",
    )
