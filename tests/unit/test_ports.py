"""The tests' free ports: distinct, bindable, and outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.support import ROOT, ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    given = [ports.free_port() for _ in range(300)]
    assert len(set(given)) == len(given)
    assert all(ports._LOW <= p < ports._HIGH for p in given)
    for port in given[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_something_holds_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_LOW", taken)
        monkeypatch.setattr(ports, "_HIGH", taken + 50)
        monkeypatch.setattr(ports, "_cursor", taken)
        assert ports.free_port() != taken


def _walk_from(monkeypatch, port: int) -> None:
    monkeypatch.setattr(ports, "_LOW", port)
    monkeypatch.setattr(ports, "_HIGH", port + 50)
    monkeypatch.setattr(ports, "_cursor", port)


def test_a_port_another_process_picked_is_not_given_again(monkeypatch):
    # The other pytest worker or a benchmark script walks the same range: a port
    # it picked and holds no socket on yet (its daemon still starting) stays its own.
    code = (
        "import sys; from tests.support import ports; "
        "print(ports.free_port(), flush=True); sys.stdin.read()"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert other.stdout is not None
        theirs = int(other.stdout.readline())
        _walk_from(monkeypatch, theirs)
        assert ports._bindable(theirs) and ports.free_port() != theirs
    finally:
        other.communicate("")
    _walk_from(monkeypatch, theirs)  # it exited: the kernel dropped its claim
    assert ports.free_port() == theirs


def test_a_block_of_ports_is_consecutive_and_never_given_again():
    block = ports.free_ports(3)
    assert block == list(range(block[0], block[0] + 3))
    assert not set(block) & {ports.free_port() for _ in range(20)}
