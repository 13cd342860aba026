"""``/dashboard/login``: the admin token in a form, traded for a session cookie.

The cookie holds an HMAC of the token (:func:`mlxd.api.http.access.cookie_value`),
never the token; ``?next=`` says where to go after, and only dashboard paths
on this server are followed.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any
from urllib.parse import parse_qs

from litestar import Controller, Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.params import QueryParameter
from litestar.response import Redirect

from mlxd.api.http.access import COOKIE, cookie_value, is_loopback
from mlxd.api.http.body import read_body
from mlxd.api.ops.stats import NO_STORE
from mlxd.api.state import Mlxd
from mlxd.config import Settings
from mlxd.dashboard.templating import render

LOGIN_PATH = "/dashboard/login"
LOGIN_MAX_BODY = 4096
COOKIE_MAX_AGE = 7 * 24 * 3600


def safe_next(value: str | None) -> str:
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


class LoginController(Controller):
    path = LOGIN_PATH

    @get("/")
    async def form(
        self, mlxd: Mlxd, next_path: Annotated[str | None, QueryParameter(name="next")] = None
    ) -> Response[str]:
        """The login form (``?next=`` is where to go after)."""
        return _login_page(mlxd.settings, safe_next(next_path))

    @post("/", status_code=303)
    async def login(self, request: Request, mlxd: Mlxd) -> Response[Any]:
        """Check the admin token; on success set the session cookie and go on."""
        fields = parse_qs((await read_body(request, LOGIN_MAX_BODY)).decode("utf-8", "replace"))
        given = fields.get("token", [""])[0].strip()
        next_path = safe_next(fields.get("next", [None])[0])
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
