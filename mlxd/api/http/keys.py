"""API keys on ``/v1``: who is asking (``Authorization: Bearer <key>`` or ``x-api-key``).

A key is an identity (:class:`Who`): a ``[keys.<name>]`` table, or an entry
of ``[server] api_keys`` (normal priority, no limits, named
``api_keys[0]``, ...). With no key configured at all, ``/v1`` is open and
requests have no identity. The guard puts the key's :class:`Who` in the
request's :class:`~mlxd.api.http.caller.Caller`; the name, never the secret,
is what logs, ``/stats``, the dashboard and ``/metrics`` show.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from mlxd.config import Settings


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


def identify(headers: Mapping[str, str], settings: Settings) -> tuple[Who, str] | None:
    """The identity the request's key names and that key's :func:`key_digest` (what owns
    what the request creates), or None (compared in constant time).

    ``Authorization: Bearer`` is the key when the request sends one; ``x-api-key``
    only when it does not. So an invalid Bearer beside a valid ``x-api-key`` is
    None, never the second key.
    """
    given = _given(headers)
    if not given:
        return None
    candidate, found = given[0], None
    for secret, who in identities(settings):
        if hmac.compare_digest(candidate, secret.encode()) and found is None:
            found = who, key_digest(secret)
    return found
