"""``GET /stats``: the daemon's state as JSON, and who may read it.

The body is the default chat model's :meth:`Engine.snapshot` (an immutable
value the engine thread swaps in after every step, so reading it never waits
on the engine loop), the daemon's config version and reload log, and the
fleet. The field-by-field contract is docs/api.md ("GET /stats").
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Response, get
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from mlxd.api.http.access import admin_refusal, can_read
from mlxd.api.http.errors import OpenAIError
from mlxd.api.state import AppState, Mlxd
from mlxd.config import Settings

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


def daemon_stats(state: AppState, now: float) -> dict[str, Any]:
    """The default chat model's snapshot with the daemon's ``config`` and ``reloads``."""
    return {**state.engine.snapshot().as_dict(now), **state.reload_log.as_dict()}


class StatsController(Controller):
    path = "/stats"
    guards = [read_guard]

    @get("/")
    async def stats(self, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """The current state (docs/api.md ("GET /stats"))."""
        body = daemon_stats(mlxd, time.time())
        # Every configured model, and the memory budget they share (docs/api.md).
        body["fleet"] = mlxd.fleet.status().as_dict()
        body["responses"] = responses_stats(mlxd)
        return Response(body, headers=NO_STORE)


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
