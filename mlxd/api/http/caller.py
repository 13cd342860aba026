"""Who a ``/v1`` request runs as: one :class:`Caller`, resolved once by the API-key guard.

The guard (:func:`api_key_guard`) puts the caller in the request's ASGI scope:
the API key's identity (:class:`~mlxd.api.http.keys.Who`, None when ``/v1``
is open) and, for a Batch API line, the line it runs for. The lease, the
generation path and the routes read it with :func:`caller_of` and ask it
their questions (which class, which quotas, which models, stored or not)
instead of each looking in the scope.

A Batch API line's caller is placed in process by the batch runner
(:func:`mlxd.api.batches.dispatch.run_line`), as the key that created its
batch: no client can set an ASGI scope key, so the guard trusts a caller it
finds there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.keys import Who, identify, keys_configured
from mlxd.api.http.requestlog import note_of

# Where the caller lives in the ASGI scope (a key of mlxd's own).
CALLER_SCOPE_KEY = "mlxd.caller"


@dataclass(frozen=True)
class BatchLine:
    """The Batch API line a request runs for."""

    batch_id: str
    custom_id: str


@dataclass(frozen=True)
class Caller:
    """One request's caller: its API key and, for a Batch API line, the line.

    A line runs as its owner's key (its name, its ``models``) in the idle-time
    ``batch`` class, outside the key's quotas, and is never stored by the
    Responses API (docs/batches.md).
    """

    # The key's identity: None when /v1 is open (or a line's key is gone).
    who: Who | None = None
    line: BatchLine | None = None
    # The digest of the key the request presented (keys.key_digest): what owns
    # the Batch API files and batches and the stored responses it creates.
    # None when /v1 is open, and for a line (it presents no key).
    owner: str | None = None

    @property
    def key(self) -> str | None:
        """The key's name (never its secret): what logs and the engine's ``client`` show."""
        return self.who.name if self.who is not None else None

    @property
    def is_batch_line(self) -> bool:
        """Whether the request is a Batch API line, run in process by the batch runner."""
        return self.line is not None

    @property
    def priority(self) -> str:
        """The most urgent class the request may run at: ``batch`` for a line, else its key's."""
        if self.line is not None:
            return "batch"
        return self.who.priority if self.who is not None else "normal"

    @property
    def spends_quota(self) -> bool:
        """Whether the request counts against its key's quotas (a line runs in idle time)."""
        return self.line is None

    @property
    def stores_responses(self) -> bool:
        """Whether the Responses API may store its answer (lines would evict users' ones)."""
        return self.line is None

    def may_use(self, *names: str | None) -> bool:
        """Whether the key allows any of ``names`` (any model without a key)."""
        return self.who is None or self.who.may_use(*names)


def caller_of(scope: Any) -> Caller:
    """The caller the guard resolved for this request (an anonymous one outside ``/v1``)."""
    return _placed(scope) or Caller()


def _placed(scope: Any) -> Caller | None:
    caller = scope.get(CALLER_SCOPE_KEY) if isinstance(scope, dict) else None
    return caller if isinstance(caller, Caller) else None


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """``/v1`` needs a key when any is configured (Bearer, or Anthropic's x-api-key).

    Puts the request's :class:`Caller` in its scope; a 401 without a valid key.
    The secret itself goes no further than here: the caller holds the key's
    name and identity, and the digest that owns what the request creates.
    """
    # A key of mlxd's own in the ASGI scope (Litestar's Scope type lists only its own).
    scope = cast("dict[str, Any]", connection.scope)
    placed = _placed(scope)
    settings = connection.app.state.mlxd.settings
    if not keys_configured(settings):
        if placed is None:
            scope[CALLER_SCOPE_KEY] = Caller()
        return
    if placed is not None and placed.who is not None:
        # Set in process: a Batch API line runs as the key that created its batch.
        note_of(connection.scope).key = placed.who.name
        return
    found = identify(connection.headers, settings)
    if found is None:
        raise OpenAIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>').",
            code="invalid_api_key",
            # A body the guard refused is never read: close rather than wait for it.
            headers={"Connection": "close"} if _has_body(connection.headers) else None,
        )
    who, owner = found
    placed = placed or Caller()
    scope[CALLER_SCOPE_KEY] = replace(placed, who=who, owner=owner)
    note_of(connection.scope).key = who.name


def _has_body(headers: Any) -> bool:
    length = headers.get("content-length", "0")
    return length.strip() not in ("", "0") or "transfer-encoding" in headers
