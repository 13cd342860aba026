"""The CSRF token the editor's forms carry (Litestar's ``CSRFConfig``)."""

from __future__ import annotations

import hmac

from litestar import Request
from litestar.datastructures import Cookie
from litestar.middleware.csrf import generate_csrf_hash, generate_csrf_token
from litestar.utils.scope.state import ScopeState


def csrf_token(request: Request) -> tuple[str, Cookie | None]:
    """The CSRF token to embed, and a cookie to set when the browser's one is stale.

    Litestar's middleware keeps whatever cookie the browser sends; one signed
    by a previous process (the secret is per process) would fail every form
    after a restart, so the page replaces it.
    """
    config = request.app.csrf_config
    if config is None:
        return "", None
    token = ScopeState.from_scope(request.scope).csrf_token
    if isinstance(token, str) and len(token) > 64:
        expected = generate_csrf_hash(token[:64], config.secret)
        if hmac.compare_digest(token[64:], expected):
            return token, None
    token = generate_csrf_token(config.secret)
    if request.method != "GET":
        return token, None  # a refusal: no form on it, and the browser's cookie stays
    cookie = Cookie(
        key=config.cookie_name,
        value=token,
        path=config.cookie_path,
        secure=config.cookie_secure,
        httponly=config.cookie_httponly,
        samesite=config.cookie_samesite,
        domain=config.cookie_domain,
    )
    return token, cookie
