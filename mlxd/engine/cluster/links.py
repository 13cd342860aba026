"""The ring's TCP links, checked from outside MLX: has a peer closed its end?

MLX's ``ring`` backend (0.32) usually turns a dead peer into an exception
in the waiting collective, but not always: a socket's worker thread gives
up after ten failed reads or writes, fails the tasks it holds and exits,
and a task queued on that socket afterwards is never run, so the
collective that queued it waits forever (docs/upstream/mlx-ring-orphaned-tasks.md).
The :class:`~.watchdog.Watchdog` would end that wait only after
``step_timeout``. Instead, while a wait is under way, it asks
:meth:`Links.closed`: the kernel knows at once when a peer process died
(its sockets were closed, a FIN or a reset arrived), and a peek reads
that without taking a byte from MLX.

The links are found after ``mx.distributed.init`` among this process's
open sockets: the TCP connections whose local address is one of this
rank's hostfile addresses (accepted from a neighbour) or whose remote
address is another rank's (connected to a neighbour). Each is kept as a
duplicate descriptor, so a closed and reused number is never peeked.
"""

from __future__ import annotations

import logging
import os
import select
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

logger = logging.getLogger(__name__)

# Where a process lists its open descriptors (Linux and macOS).
FD_DIR = "/dev/fd"
# poll() events that mean the peer is gone: hung up both ways, or an error (a reset).
# A half-close shows as an empty peek once the bytes before it are read: a rank
# that sent its last plan and exited 0 is not gone until its neighbours read it.
_HUP = select.POLLHUP | select.POLLERR

Address: TypeAlias = tuple[str, int]
Pair: TypeAlias = tuple[Address, Address]


@dataclass(frozen=True)
class Link:
    """One TCP connection of the ring: our duplicate of it and the peer's address."""

    sock: socket.socket
    peer: str


def resolve(endpoints: Iterable[str]) -> set[Address]:
    """``"host:port"`` strings as the (ip, port) pairs they resolve to; bad ones skipped."""
    found: set[Address] = set()
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            continue
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        found.update((str(info[4][0]), int(info[4][1])) for info in infos)
    return found


class Links:
    """This rank's connections to its ring neighbours; none until :meth:`find`."""

    def __init__(self) -> None:
        self.links: tuple[Link, ...] = ()

    def find(self, endpoints: Sequence[Sequence[str]], rank: int) -> None:
        """Look for the links among this process's sockets; call right after ``init``.

        Args:
            endpoints: Every rank's hostfile addresses (``"ip:port"``), by rank.
            rank: This rank.
        """
        mine = resolve(endpoints[rank]) if rank < len(endpoints) else set()
        theirs = {
            address: r
            for r, ranks in enumerate(endpoints)
            if r != rank
            for address in resolve(ranks)
        }
        self.close()
        self.links = tuple(_find(mine, theirs)) if mine or theirs else ()
        logger.info(
            "cluster: watching %d ring link(s)%s",
            len(self.links),
            f" ({', '.join(link.peer for link in self.links)})" if self.links else "",
        )

    def closed(self) -> str | None:
        """The first link its peer closed (or reset), described; ``None`` while all stand."""
        for link in self.links:
            why = _gone(link.sock)
            if why is not None:
                return f"{link.peer} {why}"
        return None

    def close(self) -> None:
        """Drop our duplicates (the ring's own descriptors stay open)."""
        for link in self.links:
            link.sock.close()
        self.links = ()


def _find(mine: set[Address], theirs: dict[Address, int]) -> list[Link]:
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return []
    # By (local, remote) address: the listing may name a descriptor that our own dup
    # reuses once listdir's has closed, and one connection must count once.
    found: dict[Pair, Link] = {}
    for name in names:
        if not name.isdigit():
            continue
        got = _link(int(name), mine, theirs)
        if got is None:
            continue
        pair, link = got
        if pair in found:
            link.sock.close()
        else:
            found[pair] = link
    return list(found.values())


def _link(fd: int, mine: set[Address], theirs: dict[Address, int]) -> tuple[Pair, Link] | None:
    try:
        dup = os.dup(fd)
    except OSError:
        return None  # closed since it was listed
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None  # not a socket
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise OSError("not a TCP socket")
        local, peer = sock.getsockname(), sock.getpeername()
        here, there = (str(local[0]), int(local[1])), (str(peer[0]), int(peer[1]))
        where = f"{there[0]}:{there[1]}"
        if there in theirs:
            return (here, there), Link(sock, f"rank {theirs[there]} at {where}")
        if here in mine:
            return (here, there), Link(sock, f"the neighbour connected from {where}")
        raise OSError("not a ring link")
    except OSError:
        sock.close()
        return None


def _gone(sock: socket.socket) -> str | None:
    """Why the peer of ``sock`` is surely gone, or ``None``; reads nothing."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | _HUP)
    events = poller.poll(0)
    mask = events[0][1] if events else 0
    if mask & _HUP:
        return "closed its connection"
    if not mask & select.POLLIN:
        return None
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        return f"reset its connection ({exc.strerror or exc})"
    # Bytes waiting are a live peer's; an empty read is its end of stream.
    return None if data else "closed its connection"
