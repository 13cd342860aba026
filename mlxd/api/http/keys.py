"""API keys on ``/v1``: who is asking (``Authorization: Bearer <key>`` or ``x-api-key``).

A key is an identity (:class:`Who`): a ``[keys.<name>]`` table, or an entry
of ``[server] api_keys`` (normal priority, no limits, named
``api_keys[0]``, ...). With no key configured at all, ``/v1`` is open and
requests have no identity. The guard stores the caller's :class:`Who` in the
ASGI scope (:func:`who_of`); the name, never the secret, is what logs,
``/stats``, the dashboard and ``/metrics`` show.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from pydantic import SecretStr

from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import note_of
from mlxd.config import Settings

# Where the guard keeps the caller's Who in the ASGI scope (a Batch API line
# carries its owner's there from the start: no client can set a scope key).
WHO_SCOPE_KEY = "mlxd.who"


@dataclass(frozen=True)
class Who:
    """One API key as an identity: its name, class, models and quotas (0 = unlimited)."""

    name: str
    priority: str = "normal"
    models: tuple[str, ...] = ()
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0

    def may_use(self, *names: str | None) -> bool:
        """Whether any of ``names`` (the model id, the name the client sent) is allowed."""
        if not self.models:
            return True
        return any(
            fnmatch.fnmatchcase(name, pattern) for name in names if name for pattern in self.models
        )


def identities(settings: Settings) -> list[tuple[str, Who]]:
    """Every configured key: ``(secret, who)``; a ``key_env`` that is unset names no key."""
    out = [
        (key.get_secret_value(), Who(f"api_keys[{i}]"))
        for i, key in enumerate(settings.server.api_keys)
    ]
    for name, entry in settings.keys.items():
        secret = entry.secret()
        if secret:
            out.append(
                (
                    secret,
                    Who(
                        name,
                        entry.priority,
                        tuple(entry.models),
                        entry.requests_per_minute,
                        entry.tokens_per_minute,
                        entry.max_concurrent,
                    ),
                )
            )
    return out


def secrets(settings: Settings) -> list[SecretStr]:
    """Every configured key's secret: ``[server] api_keys`` and ``[keys.*]`` (set ones)."""
    return [SecretStr(secret) for secret, _ in identities(settings)]


def key_digest(secret: str) -> str:
    """The stable name of what a key owns on disk (Batch API files and batches).

    A SHA-256 of the secret: it outlives restarts, and a key is a long random
    secret, so the digest reveals nothing.
    """
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def who_by_digest(digest: str | None, settings: Settings) -> Who | None:
    """The configured key whose :func:`key_digest` is ``digest`` (None: no such key now)."""
    if digest is None:
        return None
    for secret, who in identities(settings):
        if hmac.compare_digest(key_digest(secret), digest):
            return who
    return None


def keys_configured(settings: Settings) -> bool:
    """Whether ``/v1`` needs a key: any ``[server] api_keys`` entry or ``[keys.*]`` table."""
    return bool(settings.server.api_keys or settings.keys)


def _given(headers: Mapping[str, str]) -> list[bytes]:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    given.append(headers.get("x-api-key", "").strip())
    return [g.encode() for g in given if g]


def identify(headers: Mapping[str, str], settings: Settings) -> Who | None:
    """The identity the request's key names, or None (compared in constant time)."""
    given = _given(headers)
    found = None
    for secret, who in identities(settings):
        for candidate in given:
            if hmac.compare_digest(candidate, secret.encode()) and found is None:
                found = who
    return found


def presented_key(headers: Mapping[str, str], keys: Sequence[SecretStr]) -> str | None:
    """The one of ``keys`` that ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
    names, or None."""
    for candidate in _given(headers):
        for key in keys:
            secret = key.get_secret_value()
            if secret and hmac.compare_digest(candidate, secret.encode()):
                return secret
    return None


def key_accepted(headers: Mapping[str, str], keys: Sequence[SecretStr]) -> bool:
    """Whether ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` names one of ``keys``."""
    return presented_key(headers, keys) is not None


def who_of(scope: Any) -> Who | None:
    """The identity the guard found for this request (None when ``/v1`` is open)."""
    who = scope.get(WHO_SCOPE_KEY) if isinstance(scope, dict) else None
    return who if isinstance(who, Who) else None


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """``/v1`` needs a key when any is configured (Bearer, or Anthropic's x-api-key)."""
    settings = connection.app.state.mlxd.settings
    if not keys_configured(settings):
        return
    if who_of(connection.scope) is not None:
        return  # set in process: a Batch API line runs as the key that created its batch
    who = identify(connection.headers, settings)
    if who is None:
        raise OpenAIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>').",
            code="invalid_api_key",
        )
    # A key of mlxd's own in the ASGI scope (Litestar's Scope type lists only its own).
    cast("dict[str, Any]", connection.scope)[WHO_SCOPE_KEY] = who
    note_of(connection.scope).key = who.name
