"""The whole web app: the API's routes, the dashboard's and the static files, in one Litestar app.

Above both :mod:`mlxd.api` and :mod:`mlxd.dashboard` (the dashboard reads
the API's state), so neither imports the other's way up.
"""

from __future__ import annotations

import secrets

from litestar import Litestar
from litestar.config.csrf import CSRFConfig
from litestar.di import Provide
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler

from mlxd.api.app import ERROR_ENVELOPES, api_route_handlers
from mlxd.api.batches.service import BatchService
from mlxd.api.http.errors import error_handlers
from mlxd.api.ops.downloads import DownloadService
from mlxd.api.state import AppState, provide_app_state
from mlxd.dashboard.batch_actions import BatchActionsController
from mlxd.dashboard.download_actions import DownloadActionsController
from mlxd.dashboard.editor import EditorController
from mlxd.dashboard.login import LoginController
from mlxd.dashboard.model_actions import ModelActionsController
from mlxd.dashboard.page import DashboardController, to_dashboard
from mlxd.paths import static_dir

__all__ = ["CSRF_EXCLUDE", "ERROR_ENVELOPES", "make_app", "make_csrf_config", "route_handlers"]

# The dashboard's forms (the config editor) carry a double-submit CSRF token.
# JSON APIs are left out: /v1 takes bearer API keys, /admin the admin token
# and a same-origin check; the login form only sets a cookie; the read-only
# endpoints need no cookie of their own.
CSRF_EXCLUDE = [
    "^/v1(/|$)",
    "^/rerank$",
    "^/admin(/|$)",
    "^/dashboard/login(/|$)",
    "^/(health|ready|stats|metrics|static)(/|$)",
]


def route_handlers() -> list[ControllerRouterHandler]:
    """Every route mlxd serves: the APIs under ``/v1``, operations, the dashboard."""
    static = create_static_files_router(
        path="/static", directories=[static_dir()], name="static", include_in_schema=False
    )
    return [
        *api_route_handlers(),  # /v1, /health, /ready, /stats, /metrics, /admin, HEAD /
        to_dashboard,  # / -> /dashboard
        DashboardController,  # /dashboard and its regions
        LoginController,  # /dashboard/login
        EditorController,  # /dashboard/config
        ModelActionsController,  # /dashboard/models
        DownloadActionsController,  # /dashboard/downloads
        BatchActionsController,  # /dashboard/batches/cancel
        static,  # /static
    ]


def make_csrf_config() -> CSRFConfig:
    """A per-process secret: a restart invalidates old tokens (the editor page renews them)."""
    return CSRFConfig(
        secret=secrets.token_hex(32),
        cookie_name="mlxd_csrf",
        cookie_path="/dashboard",
        header_name="x-csrf-token",
        cookie_httponly=True,  # the page embeds the token; scripts never read the cookie
        cookie_samesite="strict",
        exclude=CSRF_EXCLUDE,
    )


def make_app(state: AppState) -> Litestar:
    """Build the app around ``state``; the engines are started and stopped by the caller."""
    app = Litestar(
        route_handlers=route_handlers(),
        dependencies={"mlxd": Provide(provide_app_state, sync_to_thread=False)},
        csrf_config=make_csrf_config(),
        exception_handlers=error_handlers(ERROR_ENVELOPES),
        # Bodies are read under the live limits.max_body_bytes instead.
        request_max_body_size=None,
        openapi_config=None,
        # mlxd configures logging itself (timestamps and levels on stderr).
        logging_config=None,
        debug=False,
    )
    app.state.mlxd = state
    # Started on the event loop by the server; it runs batch lines through ``app``.
    state.batches = BatchService(state, app)
    # Hub downloads; with [server] downloads = true, missing repos are pulled at start.
    state.downloads = DownloadService(state)
    app.on_startup.append(state.downloads.autostart)
    return app
