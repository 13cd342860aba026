"""The ring's links are found among real sockets, and a peer that closes one is seen at once."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from mlxd.engine.cluster.links import Links, resolve
from mlxd.engine.cluster.watchdog import Watchdog


def _listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


@pytest.fixture
def ring():
    """This rank listens on ``mine`` (a neighbour connected in) and connected out to ``theirs``.

    ``other`` is a TCP connection to an address outside the hostfile (an
    HTTP client, say): never a link.
    """
    mine, theirs, other = _listener(), _listener(), _listener()
    neighbour_in = socket.create_connection(mine.getsockname()[:2])
    accepted, _ = mine.accept()
    out = socket.create_connection(theirs.getsockname()[:2])
    neighbour_out, _ = theirs.accept()
    stray = socket.create_connection(other.getsockname()[:2])
    stray_far, _ = other.accept()
    endpoints = ((_address(mine),), (_address(theirs),))
    yield endpoints, {"in": neighbour_in, "out": neighbour_out}, {"accepted": accepted, "out": out}
    for s in (mine, theirs, other, neighbour_in, accepted, out, neighbour_out, stray, stray_far):
        s.close()


@pytest.fixture
def links(ring):
    """The links rank 0 of ``ring`` finds; its duplicates closed after the test."""
    found = Links()
    found.find(ring[0], 0)
    yield found
    found.close()


def test_the_links_are_the_connections_to_and_from_the_hostfile_addresses(ring, links):
    endpoints, _, near = ring
    accepted_from = "{}:{}".format(*near["accepted"].getpeername()[:2])
    assert sorted(link.peer for link in links.links) == [
        f"rank 1 at {endpoints[1][0]}",
        f"the neighbour connected from {accepted_from}",
    ]
    assert links.closed() is None


def _closed_within(links: Links, seconds: float) -> str | None:
    """What :meth:`Links.closed` says once it says something, or ``None`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (gone := links.closed()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return gone


@pytest.mark.parametrize("end", ["in", "out"])
def test_a_peer_closing_either_link_is_seen_once_its_bytes_are_read(ring, links, end):
    _, far, near = ring
    sock = near["accepted" if end == "in" else "out"]
    far[end].sendall(b"xy")
    far[end].close()
    time.sleep(0.05)
    # A peer's last bytes are read before its end counts (a rank that sent its last
    # plan and exited 0 is not lost to the others).
    assert links.closed() is None
    assert sock.recv(2) == b"xy"  # the peeks took nothing from the ring's own reader
    gone = _closed_within(links, 5)
    assert gone is not None
    assert "{}:{}".format(*sock.getpeername()[:2]) in gone


def test_closing_our_duplicates_leaves_the_ring_open(ring, links):
    _, far, near = ring
    links.close()
    near["out"].sendall(b"ok")
    assert far["out"].recv(2) == b"ok"


def test_unresolvable_and_malformed_addresses_are_skipped():
    assert resolve(["127.0.0.1:5000", "no-port", "host:abc", "[::1]:6000"]) >= {("127.0.0.1", 5000)}
    assert resolve(["no-port", "x:y"]) == set()


def _fires(probe, timeout: float = 60.0) -> tuple[Watchdog, list[str], threading.Event]:
    fired: list[str] = []
    done = threading.Event()

    def on_timeout(reason: str) -> None:
        fired.append(reason)
        done.set()

    dog = Watchdog(timeout, on_timeout, waiting="a step waited", culprit="a peer", probe=probe)
    dog.start()
    return dog, fired, done


def test_a_wait_on_a_peer_that_is_gone_ends_long_before_the_timeout():
    dog, fired, done = _fires(lambda: "10.0.0.2:5000 closed its connection")
    try:
        dog.arm()
        assert done.wait(10), "the probe never ended the wait"
        assert "a step waited, but 10.0.0.2:5000 closed its connection" in fired[0]
    finally:
        dog.stop()


def test_the_probe_is_not_asked_while_nothing_waits():
    asked = []

    def probe() -> str | None:
        asked.append(1)
        return "gone"

    dog, fired, done = _fires(probe)
    try:
        assert not done.wait(1.5)
        assert asked == [] and fired == []
        dog.arm()
        assert done.wait(10)
    finally:
        dog.stop()


def test_a_reset_link_is_seen_at_once(ring, links):
    """A peer that dies with bytes unread sends a reset, not an orderly close."""
    endpoints, far, _ = ring
    far["out"].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    far["out"].close()  # linger 0: an RST
    assert _closed_within(links, 5) == f"rank 1 at {endpoints[1][0]} closed its connection"
