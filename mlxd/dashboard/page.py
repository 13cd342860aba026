"""The dashboard page at ``/dashboard`` and each region's refresh route.

The page is the same partial templates that each region polls at
``/dashboard/<region>`` (:mod:`mlxd.dashboard.regions`), so the first render
and every refresh take one path. Reading needs what
:func:`mlxd.api.http.access.can_read` allows; a browser that may not read is
sent to the login form (:mod:`mlxd.dashboard.login`).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any
from urllib.parse import quote

from litestar import Controller, Request, Response, get
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.response import Redirect

from mlxd.api.http.access import can_admin, can_read, exposure_warning
from mlxd.api.ops.recent import install_recent
from mlxd.api.ops.stats import NO_STORE, daemon_stats
from mlxd.api.ops.who import keys_stats
from mlxd.api.state import AppState, Mlxd
from mlxd.dashboard import logtail, procmem
from mlxd.dashboard.batch_actions import batches_state
from mlxd.dashboard.login import LOGIN_PATH
from mlxd.dashboard.model_actions import panel_state
from mlxd.dashboard.regions import REGIONS, format_page, format_region
from mlxd.dashboard.templating import render


class LoginRequired(Exception):
    """Raised by :func:`dashboard_guard`; answered with a redirect to the login form."""


def dashboard_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    if not can_read(connection, connection.app.state.mlxd.settings):
        raise LoginRequired


def _to_login(request: Request, _: LoginRequired) -> Response[Any]:
    if request.headers.get("hx-request"):
        # A region's poll after the cookie went stale (the token changed): htmx
        # moves the whole page to the login form, and back to the page after.
        target = f"{LOGIN_PATH}?next=/dashboard"
        return Response("", headers={"HX-Redirect": target, **NO_STORE})
    target = f"{LOGIN_PATH}?next={quote(request.url.path)}"
    return Redirect(target, status_code=303, headers=NO_STORE)


def dashboard_state(
    request: Request, mlxd: AppState, now: float, *, fleet: bool = True
) -> dict[str, Any]:
    """``/stats`` as a dict as of ``now``, plus what the HTTP side knows: recent latency,
    the process's memory and, for admins only, the log tail, the prompt-cache snippets and
    the models panel's buttons."""
    admin = can_admin(request, mlxd.settings)
    state = daemon_stats(mlxd, now, admin=admin)
    state["latency"] = install_recent(mlxd).percentiles(now)
    rss_bytes, rss_label = procmem.rss()
    state["process"] = {"rss_bytes": rss_bytes, "rss_label": rss_label}
    state["log_tail"] = [asdict(e) for e in logtail.TAIL.entries()] if admin else None
    state["admin"] = admin
    state["daemon_started_at"] = mlxd.started_at
    state["keys"] = keys_stats(mlxd)
    if fleet:  # only the models panel and the status bar read it
        state |= panel_state(request, mlxd, admin)
    state |= batches_state(request, mlxd, admin)
    return state


class DashboardController(Controller):
    path = "/dashboard"
    guards = [dashboard_guard]
    exception_handlers = {LoginRequired: _to_login}

    @get("/")
    async def page(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """The whole dashboard: every region rendered once, each then polls itself."""
        now = time.time()
        return render(
            "dashboard.html",
            regions=format_page(dashboard_state(request, mlxd, now), now),
            exposure=exposure_warning(mlxd.settings),
        )

    @get([f"/{region}" for region in REGIONS])
    async def region(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """One region's partial: its root element, ready to replace itself (outerHTML)."""
        region = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        now = time.time()
        # The status bar names the default model from the fleet while it is unloaded.
        state = dashboard_state(request, mlxd, now, fleet=region in ("models", "status-bar"))
        return render(f"partials/{region}.html", v=format_region(region, state, now))


@get("/", include_in_schema=False)
async def to_dashboard() -> Redirect:
    """``/`` goes to the dashboard."""
    return Redirect("/dashboard", status_code=302)
