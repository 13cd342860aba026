"""Refusing a dashboard request: the one admin rule its writing controllers share.

The config editor and the model actions answer refusals in their own HTML,
each with its controller's exception handler for :class:`DashboardRefused`.
"""

from __future__ import annotations

from litestar.connection import ASGIConnection

from mlxd.api.http.access import admin_refusal, can_admin, changes_state
from mlxd.api.ops.admin import same_origin


class DashboardRefused(Exception):
    """A dashboard request refused with ``status`` and a message for people."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def require_admin(connection: ASGIConnection, what: str) -> None:
    """Admin access (401, or 403 with no admin token off loopback); writes same-origin only."""
    settings = connection.app.state.mlxd.settings
    if not can_admin(connection, settings):
        status = 403 if settings.server.admin_token is None else 401
        raise DashboardRefused(status, admin_refusal(settings))
    if changes_state(connection) and not same_origin(connection):
        raise DashboardRefused(403, f"cross-site requests to the {what} are refused")
