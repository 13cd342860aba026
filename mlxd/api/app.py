"""The Litestar application: every route mlxd serves, in one list, and its error envelopes."""

from __future__ import annotations

import secrets

from litestar import Litestar, Router
from litestar.config.csrf import CSRFConfig
from litestar.di import Provide
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler

from mlxd.api.anthropic.errors import ANTHROPIC
from mlxd.api.anthropic.routes import MESSAGES_PATH, messages_router
from mlxd.api.batches.files import FilesController
from mlxd.api.batches.routes import BatchesController
from mlxd.api.batches.service import BatchService
from mlxd.api.http.caller import api_key_guard
from mlxd.api.http.errors import OPENAI, Envelopes, error_handlers
from mlxd.api.http.requestlog import request_log
from mlxd.api.openai.embeddings import EmbeddingsController
from mlxd.api.openai.routes import OpenAIController
from mlxd.api.ops.admin import AdminController
from mlxd.api.ops.health import HealthController, root_probe
from mlxd.api.ops.metrics import MetricsController
from mlxd.api.ops.stats import StatsController
from mlxd.api.responses.routes import ResponsesController
from mlxd.api.state import AppState, provide_app_state
from mlxd.dashboard.batch_actions import BatchActionsController
from mlxd.dashboard.editor import EditorController
from mlxd.dashboard.login import LoginController
from mlxd.dashboard.model_actions import ModelActionsController
from mlxd.dashboard.page import DashboardController, to_dashboard
from mlxd.paths import static_dir

API_PATH = "/v1"

# Errors that no router handles (a request that reaches no route, one the
# request guard refuses before routing) in the envelope of the API whose path
# holds the request: Anthropic's under /v1/messages, OpenAI's everywhere else.
ERROR_ENVELOPES = Envelopes(OPENAI, {f"{API_PATH}{MESSAGES_PATH}": ANTHROPIC})

# The dashboard's forms (the config editor) carry a double-submit CSRF token.
# JSON APIs are left out: /v1 takes bearer API keys, /admin the admin token
# and a same-origin check; the login form only sets a cookie; the read-only
# endpoints need no cookie of their own.
CSRF_EXCLUDE = [
    "^/v1(/|$)",
    "^/admin(/|$)",
    "^/dashboard/login(/|$)",
    "^/(health|ready|stats|metrics|static)(/|$)",
]


def route_handlers() -> list[ControllerRouterHandler]:
    """Every route mlxd serves: the APIs under ``/v1``, operations, the dashboard."""
    api = Router(
        path=API_PATH,
        route_handlers=[
            OpenAIController,  # /v1/models, /v1/chat/completions, /v1/completions
            EmbeddingsController,  # /v1/embeddings
            ResponsesController,  # /v1/responses
            messages_router(),  # /v1/messages: Anthropic's, in its own envelope
            FilesController,  # /v1/files (the Batch API's files)
            BatchesController,  # /v1/batches
        ],
        guards=[api_key_guard],
        middleware=[request_log],
    )
    static = create_static_files_router(
        path="/static", directories=[static_dir()], name="static", include_in_schema=False
    )
    return [
        api,
        HealthController,  # /health, /ready
        StatsController,  # /stats
        MetricsController,  # /metrics
        AdminController,  # /admin/reload
        to_dashboard,  # / -> /dashboard
        root_probe,  # HEAD /: 200 (Claude Code probes it)
        DashboardController,  # /dashboard and its regions
        LoginController,  # /dashboard/login
        EditorController,  # /dashboard/config
        ModelActionsController,  # /dashboard/models
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
    return app
