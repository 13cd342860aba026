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

Every route also checks the request's ``Host`` (:func:`host_allowed`), so a
web page on a name that an attacker rebinds to this machine's address (DNS
rebinding) is refused before routing.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from functools import cache

from litestar.connection import ASGIConnection, Request

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


def split_host(value: str) -> str:
    """The host part of a ``Host`` header or URL authority, lowercased, without port."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        value = host
    return value.rstrip(".")


@cache
def machine_names() -> frozenset[str]:
    """This machine's own names: its hostname, with and without domain, and ``.local``."""
    names = set()
    for name in (socket.gethostname(), socket.getfqdn()):
        name = name.lower().rstrip(".")
        if name:
            short = name.split(".", 1)[0]
            names.update({name, short, f"{short}.local"})
    return frozenset(names)


def host_allowed(host: str, settings: Settings) -> bool:
    """May a request carrying ``Host: host`` be served?

    IP literals are always fine (a rebinding attack needs a name the attacker
    controls), as are ``localhost`` names, this machine's own names, the bound
    ``[server] host``, and ``[server] allowed_hosts`` (``*.example.com`` matches
    subdomains; ``*`` allows every name).
    """
    name = split_host(host)
    if not name:
        return False
    allowed = settings.server.allowed_hosts
    if "*" in allowed:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name == "localhost" or name.endswith(".localhost") or name in machine_names():
        return True
    if name == split_host(settings.server.host):
        return True
    for pattern in allowed:
        if pattern.startswith("*."):
            if name.endswith(pattern[1:]):
                return True
        elif name == pattern:
            return True
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


def changes_state(connection: ASGIConnection) -> bool:
    """Whether the request may change something: any method but GET and HEAD."""
    return isinstance(connection, Request) and connection.method not in ("GET", "HEAD")


def can_read(connection: ASGIConnection, settings: Settings) -> bool:
    server = settings.server
    if is_loopback(server.host) or server.allow_anonymous_read:
        return True
    return presented_token_ok(connection, settings)


def can_admin(connection: ASGIConnection, settings: Settings) -> bool:
    if is_loopback(settings.server.host):
        return True
    return presented_token_ok(connection, settings)


def exposure_warning(settings: Settings) -> str | None:
    """What is open to the network when mlxd is bound off loopback without an admin token."""
    server = settings.server
    if is_loopback(server.host) or server.admin_token is not None:
        return None
    api = (
        "/v1 is open to anyone who can reach this address (no [server] api_keys)"
        if not (server.api_keys or settings.keys)
        else "/v1 needs an API key"
    )
    return (
        f"mlxd is bound to {server.host}, off loopback, without [server] admin_token: {api}; "
        "the dashboard and /admin cannot be used from other machines. Set admin_token "
        "(and api_keys) or bind to 127.0.0.1 behind a reverse proxy; see docs/operations.md."
    )


def admin_refusal(settings: Settings) -> str:
    """Why an admin action was refused, and what to do about it."""
    if settings.server.admin_token is None:
        return (
            "admin actions are disabled: the server is bound off loopback and "
            "[server] admin_token is not set"
        )
    return "admin token required (Authorization: Bearer <admin_token>, or log in on the dashboard)"
