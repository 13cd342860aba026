"""The listening socket, bound before anything slow happens.

``mlxd serve`` binds its port first, before MLX is imported and the model
loads, so a busy port fails at once with a message that says what to do,
instead of a raw errno after a minute of loading.
"""

from __future__ import annotations

import errno
import socket


class ListenError(Exception):
    """The port cannot be bound; ``str()`` says why and how to choose another."""


def free_port_near(host: str, port: int, tries: int = 50) -> int | None:
    """The first port after ``port`` that ``host`` can bind now (checked, then released)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for other in range(port + 1, min(port + 1 + tries, 65536)):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, other))
            except OSError:
                continue
            return other
    return None


def _how_to_choose(host: str, port: int) -> str:
    other = free_port_near(host, port)
    if other is None:
        return "choose a free port: mlxd serve --port <port>, or [server] port in the config"
    return (
        f"port {other} is free: mlxd serve --port {other}, make serve PORT={other}, "
        f"or [server] port = {other} in the config"
    )


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, for uvicorn to serve on.

    Raises:
        ListenError: the port is in use, not allowed, or the address is not this machine's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn does: a restart may rebind while old connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            why = (
                f"port {port} is already in use on {host} (another mlxd? "
                "`mlxd status --config <its config>` asks it)"
            )
        elif exc.errno == errno.EACCES:
            why = f"binding port {port} needs privileges (ports below 1024 usually do)"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = f"{host} is not an address of this machine ([server] host)"
        else:
            why = f"{exc.strerror or exc}"
        hint = _how_to_choose(host, port)
        raise ListenError(f"cannot listen on {shown}: {why}; {hint}") from None
    sock.set_inheritable(False)
    return sock
