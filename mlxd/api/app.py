"""The Litestar application: routes, error handlers, shared state."""

from __future__ import annotations

import secrets

from litestar import Litestar
from litestar.config.csrf import CSRFConfig
from litestar.exceptions import HTTPException

from mlxd.api.anthropic.routes import MessagesController
from mlxd.api.http.errors import (
    OpenAIError,
    http_error_handler,
    internal_error_handler,
    openai_error_handler,
)
from mlxd.api.http.requestlog import make_request_log
from mlxd.api.openai.embeddings import EmbeddingsController
from mlxd.api.openai.routes import OpenAIController
from mlxd.api.ops.admin import AdminController
from mlxd.api.ops.health import HealthController
from mlxd.api.responses.routes import ResponsesController
from mlxd.api.state import AppState

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


def make_app(state: AppState, *, extra_route_handlers: list | None = None) -> Litestar:
    """Build the app around ``state``; the engine is started and stopped by the caller."""
    app = Litestar(
        route_handlers=[
            OpenAIController,
            EmbeddingsController,
            ResponsesController,
            MessagesController,
            HealthController,
            AdminController,
            *(extra_route_handlers or []),
        ],
        csrf_config=make_csrf_config(),
        middleware=[make_request_log(state)],
        exception_handlers={
            OpenAIError: openai_error_handler,
            HTTPException: http_error_handler,
            Exception: internal_error_handler,
        },
        # Bodies are read under the live limits.max_body_bytes instead.
        request_max_body_size=None,
        openapi_config=None,
        # mlxd configures logging itself (timestamps and levels on stderr).
        logging_config=None,
        debug=False,
    )
    app.state.mlxd = state
    return app
