"""Who may read the dashboard and /stats, and who may change things.

- On loopback (the default ``127.0.0.1``) both are open: the machine's own
  users are trusted, as with any local daemon.
- Bound off loopback, reading needs the admin token unless
  ``[server] allow_anonymous_read``; admin actions always need the token, and
  are refused outright when none is configured.
- The token travels as ``Authorization: Bearer <token>``, the
  ``X-Mlxd-Admin-Token`` header, or a cookie set by the login form. The cookie
  holds an HMAC of the token, never the token, so changing the token (and
  reloading) logs every browser out.
- ``/v1`` API keys are never admin tokens, and the admin token is not a ``/v1`` key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from litestar.connection import ASGIConnection

from mlxd.config import Settings

COOKIE = "mlxd_admin"
HEADER = "x-mlxd-admin-token"


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cookie_value(token: str) -> str:
    """What the login cookie holds for ``token``."""
    return hmac.new(token.encode(), b"mlxd-admin-session", hashlib.sha256).hexdigest()


def presented_token_ok(connection: ASGIConnection, settings: Settings) -> bool:
    """Did the client present the configured admin token (header or cookie)?"""
    secret = settings.server.admin_token
    if secret is None:
        return False
    token = secret.get_secret_value()
    scheme, _, bearer = connection.headers.get("authorization", "").partition(" ")
    candidates = [connection.headers.get(HEADER, "")]
    if scheme.lower() == "bearer":
        candidates.append(bearer.strip())
    if any(c and hmac.compare_digest(c.encode(), token.encode()) for c in candidates):
        return True
    cookie = connection.cookies.get(COOKIE, "")
    return bool(cookie) and hmac.compare_digest(cookie, cookie_value(token))


def can_read(connection: ASGIConnection, settings: Settings) -> bool:
    server = settings.server
    if is_loopback(server.host) or server.allow_anonymous_read:
        return True
    return presented_token_ok(connection, settings)


def can_admin(connection: ASGIConnection, settings: Settings) -> bool:
    if is_loopback(settings.server.host):
        return True
    return presented_token_ok(connection, settings)


def admin_refusal(settings: Settings) -> str:
    """Why an admin action was refused, and what to do about it."""
    if settings.server.admin_token is None:
        return (
            "admin actions are disabled: the server is bound off loopback and "
            "[server] admin_token is not set"
        )
    return "admin token required (Authorization: Bearer <admin_token>, or log in on the dashboard)"
