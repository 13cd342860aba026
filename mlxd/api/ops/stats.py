"""``GET /stats``: the daemon's state as JSON, and who may read it.

The body is the default chat model's :meth:`Engine.snapshot` (an immutable
value the engine thread swaps in after every step, so reading it never waits
on the engine loop), the daemon's config version and reload log, and the
fleet. The field-by-field contract is docs/api.md ("GET /stats"). Prompt text
(the snippets around where a prompt left the prompt cache) is shown to readers
with admin access only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from litestar import Controller, Request, Response, get
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from mlxd.api.http.access import admin_refusal, can_admin, can_read
from mlxd.api.http.errors import OpenAIError, without_paths
from mlxd.api.ops.who import keys_stats
from mlxd.api.state import AppState, Mlxd
from mlxd.config import Settings
from mlxd.engine import RecentLookup

NO_STORE = {"Cache-Control": "no-store"}


def read_refusal(settings: Settings) -> OpenAIError:
    """The error for a client that may not read: 401 with a token to present, else 403."""
    if settings.server.admin_token is None:
        return OpenAIError(
            403,
            "reading is disabled: the server is bound off loopback, [server] admin_token is "
            "not set and [server] allow_anonymous_read is false",
            code="read_disabled",
        )
    return OpenAIError(
        401,
        admin_refusal(settings),
        code="admin_token_required",
        headers={"WWW-Authenticate": 'Bearer realm="mlxd"'},
    )


def read_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Let through readers that :func:`~mlxd.api.http.access.can_read` allows; else a JSON error."""
    settings = connection.app.state.mlxd.settings
    if not can_read(connection, settings):
        raise read_refusal(settings)


def daemon_stats(state: AppState, now: float, *, admin: bool) -> dict[str, Any]:
    """The default chat model's snapshot with the daemon's ``config`` and ``reloads``.

    ``prompt_cache.lookups`` are its last lookups; their prompt text (the
    snippets around the divergence point) is there for ``admin`` readers
    only, ``None`` for anyone else.
    """
    snapshot = state.engine.snapshot()
    body = {**snapshot.as_dict(now), **state.reload_log.as_dict()}
    body["prompt_cache"]["lookups"] = lookups_json(snapshot.lookups, admin=admin)
    return body


def fleet_stats(state: AppState, *, admin: bool) -> dict[str, Any]:
    """``/stats`` ``fleet``: every model and the budget; each chat model's lookups, their
    prompt text for admins only."""
    fleet = state.fleet.status().as_dict()
    snapshots = state.fleet.snapshots()
    for model in fleet.get("models", []):
        prompt_cache = model.get("engine", {}).get("prompt_cache")
        snapshot = snapshots.get(model["id"])
        if prompt_cache is not None:
            found = snapshot.lookups if snapshot is not None else ()
            prompt_cache["lookups"] = lookups_json(found, admin=admin)
    if state.downloads is not None:
        state.downloads.annotate(fleet.get("models", []))
    return fleet


def lookups_json(lookups: Sequence[RecentLookup], *, admin: bool) -> list[dict[str, Any]]:
    """The ``prompt_cache.lookups`` of /stats (docs/api.md), newest first."""
    out = []
    for recent in lookups:
        lookup = recent.lookup
        out.append(
            {
                "at": recent.at,
                "model": recent.model,
                "request_id": recent.request_id,
                "api": recent.api,
                "prompt_tokens": lookup.prompt_tokens,
                "cached_tokens": lookup.cached_tokens,
                "source": lookup.source,
                "diverged_at": lookup.diverged_at,
                "stored": lookup.stored,
                # Prompt text: admins only.
                "before": lookup.before if admin else None,
                "after": lookup.after if admin else None,
                "rules": list(recent.rules),
            }
        )
    return out


class StatsController(Controller):
    path = "/stats"
    guards = [read_guard]

    @get("/")
    async def stats(self, request: Request, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """The current state (docs/api.md ("GET /stats"))."""
        admin = can_admin(request, mlxd.settings)
        body = daemon_stats(mlxd, time.time(), admin=admin)
        # Every configured model, and the memory budget they share (docs/api.md).
        body["fleet"] = fleet_stats(mlxd, admin=admin)
        body["responses"] = responses_stats(mlxd)
        body["keys"] = keys_stats(mlxd)
        if mlxd.batches is not None:  # the Batch API (docs/api.md, ``batches``)
            body["batches"] = mlxd.batches.stats()
        return Response(body if admin else hide_paths(body), headers=NO_STORE)


def hide_paths(value: Any) -> Any:
    """``value`` with the server's file system paths as ``<path>`` (readers without admin).

    Model directories, the state and config files, the BLAS library: where
    things are on the server is the operator's business. API routes
    (``/v1/...``) are not paths.
    """
    if isinstance(value, dict):
        return {k: hide_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [hide_paths(v) for v in value]
    if isinstance(value, str) and not value.startswith("/v1/"):
        return without_paths(value)
    return value


def responses_stats(state: AppState) -> dict[str, int]:
    """The Responses store: what it holds and its bounds (docs/api.md, ``responses``)."""
    store, limits = state.responses, state.settings.responses
    store.expire()
    return {
        "stored": len(store),
        "bytes": store.bytes,
        "max_stored": limits.max_stored,
        "max_bytes": limits.max_bytes,
    }
