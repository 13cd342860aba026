"""The tests' free ports: distinct, bindable, and outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from tests.support import ports


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
