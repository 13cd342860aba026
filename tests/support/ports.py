"""Free TCP ports for the daemons, ranks and peers that tests and benchmarks start.

``bind(("127.0.0.1", 0))`` and close is the usual trick, and it races twice:
the kernel may hand the same port to the next such call before anything has
bound it (a cluster test once got its ring's port equal to rank 0's HTTP
port), and any outgoing connection may take it as its source port meanwhile.
So ports come from below the kernel's ephemeral range, which it never hands
out on its own; each process walks that range from its own start, never
gives a port twice, and skips any port something already holds.

Between the pick and the bind (a daemon's start, a cluster's ranks joining:
seconds on a loaded machine) nothing holds the port yet, so another process
walking the same stretch (the other pytest worker, a benchmark script) could
pick it too. Each pick is therefore also claimed across processes: a POSIX
record lock on the port's byte of one shared file, held until the process
that picked it exits (the kernel drops it then, even after a kill -9).
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

__all__ = ["free_port", "free_ports"]

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


# The shared file whose byte N is port N's claim (opened once per process, kept open:
# closing any descriptor of it would drop this process's locks).
# One file per user: another user's file may not be writable here.
_CLAIMS = Path(tempfile.gettempdir()) / f"mlxd-test-ports-{os.getuid()}.lock"
_claims_fd: int | None = None


def _claim(port: int) -> bool:
    """Claim ``port`` for this process's life; False if another live process has it.

    Without the claims file (an unwritable temp folder) every port counts as
    claimed by this process alone, as before claims existed."""
    global _claims_fd
    if _claims_fd is None:
        try:
            _claims_fd = os.open(_CLAIMS, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            _claims_fd = -1
    if _claims_fd < 0:
        return True
    try:
        fcntl.lockf(_claims_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    return True


def free_port() -> int:
    """A port nothing holds now, never handed out before by this process nor by any
    other process alive that uses this module."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` consecutive ports, each one as :func:`free_port` gives it (``mlx.launch``
    takes its ranks' ports from one ``--starting-port`` up)."""
    global _cursor
    with _lock:
        for _ in range(_HIGH - _LOW):
            start = _cursor
            _cursor = _cursor + 1 if _cursor + 1 < _HIGH else _LOW
            block = list(range(start, start + n))
            if block[-1] >= _HIGH or any(p in _given or not _bindable(p) for p in block):
                continue
            if all(_claim(p) for p in block):
                _given.update(block)
                _cursor = block[-1] + 1 if block[-1] + 1 < _HIGH else _LOW
                return block
    raise RuntimeError(f"no {n} free ports in a row between {_LOW} and {_HIGH}")
