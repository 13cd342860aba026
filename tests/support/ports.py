"""Free TCP ports for the daemons, ranks and peers that tests and benchmarks start.

``bind(("127.0.0.1", 0))`` and close is the usual trick, and it races twice:
the kernel may hand the same port to the next such call before anything has
bound it (a cluster test once got its ring's port equal to rank 0's HTTP
port), and any outgoing connection may take it as its source port meanwhile.
So ports come from below the kernel's ephemeral range, which it never hands
out on its own; each process walks that range from its own start, never
gives a port twice, and skips any port something already holds.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

__all__ = ["free_port"]

_LOW = 20000
_lock = threading.Lock()
_given: set[int] = set()


def _high() -> int:
    """One below the ephemeral range's start (Linux reads it; others use the IANA 49152)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 49152
    return max(low - 1, _LOW + 1000)


_HIGH = _high()
# Parallel pytest workers and concurrent runs start far apart.
_cursor = random.Random(f"{os.getpid()}-{os.environ.get('PYTEST_XDIST_WORKER', '')}").randrange(
    _LOW, _HIGH
)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing holds now, never handed out before by this process."""
    global _cursor
    with _lock:
        for _ in range(_HIGH - _LOW):
            port = _cursor
            _cursor = _cursor + 1 if _cursor + 1 < _HIGH else _LOW
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port between {_LOW} and {_HIGH}")
