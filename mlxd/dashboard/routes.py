"""The dashboard's routes, plus ``/stats``, ``/metrics`` and the static files.

``route_handlers()`` is what :mod:`mlxd.server` mounts next to the OpenAI
routes. The page at ``/dashboard`` is the same partial templates that each
region polls at ``/dashboard/<region>``, so the first render and every
refresh take one path. Reading needs what :func:`mlxd.api.http.access.can_read`
allows; a browser that may not read is sent to the login form.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import asdict
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from litestar import Controller, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.di import Provide
from litestar.handlers import BaseRouteHandler
from litestar.params import QueryParameter
from litestar.response import Redirect
from litestar.static_files import create_static_files_router

from mlxd.api.http.access import (
    COOKIE,
    can_admin,
    can_read,
    cookie_value,
    exposure_warning,
    is_loopback,
)
from mlxd.api.http.body import read_body
from mlxd.api.ops.metrics import MetricsController
from mlxd.api.ops.recent import install_recent
from mlxd.api.ops.stats import NO_STORE, StatsController
from mlxd.api.state import AppState, Mlxd, provide_app_state
from mlxd.config import Settings
from mlxd.dashboard import logtail, procmem, views
from mlxd.dashboard.editor import EditorController
from mlxd.dashboard.model_actions import ModelActionsController, panel_state
from mlxd.dashboard.templating import render
from mlxd.paths import static_dir

LOGIN_PATH = "/dashboard/login"
LOGIN_MAX_BODY = 4096
COOKIE_MAX_AGE = 7 * 24 * 3600


# ---------------------------------------------------------------- access


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


def _safe_next(value: str | None) -> str:
    """Only dashboard paths on this server; never an absolute or protocol-relative URL."""
    if value and value.startswith("/dashboard") and "//" not in value and "\\" not in value:
        return value
    return "/dashboard"


def _login_page(
    settings: Settings, next_path: str, *, error: str | None = None, status_code: int = 200
) -> Response[str]:
    server = settings.server
    return render(
        "login.html",
        status_code=status_code,
        next=next_path,
        error=error,
        enabled=server.admin_token is not None,
        open_read=is_loopback(server.host) or server.allow_anonymous_read,
    )


# ---------------------------------------------------------------- controllers


def _state(request: Request, mlxd: AppState, *, fleet: bool = True) -> tuple[dict[str, Any], float]:
    """The snapshot as a dict, plus what the HTTP side knows: recent latency, the
    process's memory, the fleet of models and, for admins only, the log tail and
    the models panel's buttons."""
    now = time.time()
    snapshot = mlxd.engine.snapshot().as_dict(now)
    snapshot["latency"] = install_recent(mlxd).view(now)
    rss_bytes, rss_label = procmem.rss()
    snapshot["process"] = {"rss_bytes": rss_bytes, "rss_label": rss_label}
    admin = can_admin(request, mlxd.settings)
    snapshot["log_tail"] = [asdict(e) for e in logtail.TAIL.entries()] if admin else None
    if fleet:  # only the models panel reads it
        snapshot |= panel_state(request, mlxd, admin)
    return snapshot, now


class DashboardController(Controller):
    path = "/dashboard"
    guards = [dashboard_guard]
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}
    exception_handlers = {LoginRequired: _to_login}

    @get("/")
    async def page(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """The whole dashboard: every region rendered once, each then polls itself."""
        snapshot, now = _state(request, mlxd)
        return render(
            "dashboard.html",
            regions=views.page_view(snapshot, now),
            exposure=exposure_warning(mlxd.settings),
        )

    @get([f"/{region}" for region in views.REGIONS])
    async def region(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """One region's partial: its root element, ready to replace itself (outerHTML)."""
        region = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        snapshot, now = _state(request, mlxd, fleet=region == "models")
        return render(f"partials/{region}.html", v=views.region_view(region, snapshot, now))


class LoginController(Controller):
    path = LOGIN_PATH
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}

    @get("/")
    async def form(
        self, mlxd: Mlxd, next_path: Annotated[str | None, QueryParameter(name="next")] = None
    ) -> Response[str]:
        """The login form (``?next=`` is where to go after)."""
        return _login_page(mlxd.settings, _safe_next(next_path))

    @post("/", status_code=303)
    async def login(self, request: Request, mlxd: Mlxd) -> Response[Any]:
        """Check the admin token; on success set the session cookie and go on."""
        fields = parse_qs((await read_body(request, LOGIN_MAX_BODY)).decode("utf-8", "replace"))
        given = fields.get("token", [""])[0].strip()
        next_path = _safe_next(fields.get("next", [None])[0])
        secret = mlxd.settings.server.admin_token
        if secret is None:
            return _login_page(
                mlxd.settings, next_path, error="no admin token is configured", status_code=403
            )
        token = secret.get_secret_value()
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            return _login_page(mlxd.settings, next_path, error="wrong token", status_code=401)
        cookie = Cookie(
            key=COOKIE,
            value=cookie_value(token),
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            max_age=COOKIE_MAX_AGE,
        )
        return Redirect(next_path, status_code=303, cookies=[cookie], headers=NO_STORE)


@get("/", include_in_schema=False)
async def root() -> Redirect:
    return Redirect("/dashboard", status_code=302)


def route_handlers() -> list:
    """Everything mlxd serves besides the OpenAI API and health checks."""
    static = create_static_files_router(
        path="/static", directories=[static_dir()], name="static", include_in_schema=False
    )
    return [
        root,
        DashboardController,
        EditorController,
        ModelActionsController,
        LoginController,
        StatsController,
        MetricsController,
        static,
    ]
