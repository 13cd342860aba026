"""Admin routes: ``POST /admin/reload``.

Guarded by :mod:`mlxd.api.http.access` (open on loopback, the admin token
elsewhere) and refused when a browser sends it cross-site, so a web page
cannot make a visitor's browser reload a loopback daemon.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from litestar import Controller, Response, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from mlxd.api.http.access import admin_refusal, can_admin, changes_state, host_allowed
from mlxd.api.http.errors import OpenAIError, error_body
from mlxd.api.reload import reload_from_file
from mlxd.api.state import Mlxd


def same_origin(connection: ASGIConnection) -> bool:
    """False when a browser says the request comes from another site.

    The ``Origin`` must name a host on the allow-list (never trusted merely
    for matching ``Host``, which a DNS-rebinding page controls too) and be
    the very address the request was sent to.
    """
    if connection.headers.get("sec-fetch-site", "") == "cross-site":
        return False
    origin = connection.headers.get("origin")
    if not origin:
        return True
    netloc = urlsplit(origin).netloc
    settings = connection.app.state.mlxd.settings
    return (
        bool(netloc)
        and host_allowed(netloc, settings)
        and netloc.lower() == connection.headers.get("host", "").lower()
    )


def admin_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    settings = connection.app.state.mlxd.settings
    if not can_admin(connection, settings):
        raise OpenAIError(401, admin_refusal(settings), code="admin_required")
    if changes_state(connection) and not same_origin(connection):
        raise OpenAIError(403, "cross-site admin requests are refused", code="cross_site")


class AdminController(Controller):
    path = "/admin"
    guards = [admin_guard]

    @post("/reload", status_code=200)
    async def reload(self, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """Re-read the config file and apply it; answers with the diff and what was applied."""
        result = await reload_from_file(mlxd, trigger="POST /admin/reload")
        body = result.as_dict()
        if result.outcome == "rejected":
            message = "invalid config, nothing changed: " + "; ".join(
                i["message"] for i in body["issues"]
            )
            return Response(
                {**error_body(400, message, code="invalid_config"), "reload": body}, status_code=400
            )
        return Response(body, status_code=200)
