"""The Responses store: bounded by count, bytes and age, each entry its owner's alone.

A fake clock for the bounds; the event loop's own timer for expiry that
happens with no request to trigger it.
"""

from __future__ import annotations

import asyncio
import time

from mlxd.api.responses.store import ResponseStore, owner_of
from mlxd.config import ResponsesSettings


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Limits:
    """The live [responses] settings, changed by the test as a reload would."""

    def __init__(self, **kw):
        self.value = ResponsesSettings(**{"max_stored": 3, "ttl": 60.0, **kw})

    def __call__(self) -> ResponsesSettings:
        return self.value

    def set(self, **kw) -> None:
        self.value = self.value.model_copy(update=kw)


def make(clock=None, **kw) -> tuple[ResponseStore, Limits]:
    limits = Limits(**kw)
    return ResponseStore(limits, clock or Clock()), limits


def put(store: ResponseStore, rid: str, *, owner: str | None = None, text: str = "") -> bool:
    body = {"id": rid, "output": text}
    return store.put(rid, body, ({"role": "user", "content": rid + text},), owner=owner)


def test_oldest_is_evicted_beyond_max_stored():
    store, _ = make()
    for rid in "abcd":
        assert put(store, rid)
    assert len(store) == 3
    assert store.get("a", owner=None) is None
    bodies = [store.get(r, owner=None) for r in "bcd"]
    assert [b.body for b in bodies if b] == [
        b'{"id":"b","output":""}',
        b'{"id":"c","output":""}',
        b'{"id":"d","output":""}',
    ]
    entry = store.get("d", owner=None)
    assert entry is not None and entry.messages() == ({"role": "user", "content": "d"},)


def test_the_store_is_bounded_by_bytes_too():
    store, limits = make(max_stored=100, max_bytes=3000)
    for i in range(5):
        assert put(store, f"r{i}", text="x" * 500)  # about 1,050 bytes each, serialized
    assert store.bytes <= 3000
    assert len(store) == 2 and store.get("r0", owner=None) is None
    assert store.get("r4", owner=None) is not None
    # One larger than the whole budget is answered but never stored.
    assert put(store, "huge", text="y" * 4000) is False
    assert store.get("huge", owner=None) is None and len(store) == 2
    # A lower bound (a reload) applies at the next call.
    limits.set(max_bytes=1500)
    assert store.get("r4", owner=None) is not None and len(store) == 1
    assert store.bytes == sum(e.size for e in [store.get("r4", owner=None)] if e)


def test_each_response_is_visible_to_the_key_that_stored_it_only():
    store, _ = make()
    k1, k2 = owner_of("k1"), owner_of("k2")
    assert k1 and k2 and k1 != k2 and "k1" not in k1  # a keyed hash, never the key
    put(store, "a", owner=k1)
    assert store.get("a", owner=k1) is not None
    assert store.get("a", owner=k2) is None
    assert store.get("a", owner=None) is None  # no key is not any key
    assert store.delete("a", owner=k2) is False
    assert store.get("a", owner=k1) is not None  # still there
    assert store.delete("a", owner=k1) is True and len(store) == 0
    # Without keys there are no owners.
    put(store, "b")
    assert store.get("b", owner=None) is not None
    assert store.get("b", owner=k1) is None


def test_expired_entries_are_gone():
    clock = Clock()
    store, limits = make(clock)
    put(store, "a")
    clock.now += 30
    put(store, "b")
    clock.now += 31  # a is 61 s old, b 31 s
    assert store.get("a", owner=None) is None
    assert store.get("b", owner=None) is not None
    assert len(store) == 1
    # A shorter ttl (a reload) applies at once.
    limits.set(ttl=10.0)
    assert store.get("b", owner=None) is None
    assert store.bytes == 0


def test_entries_expire_on_time_with_no_request_to_notice():
    async def run() -> tuple[int, int, int]:
        store, _ = make(time.monotonic, ttl=0.2)
        put(store, "a", text="z" * 1000)
        before = len(store), store.bytes
        await asyncio.sleep(0.6)
        return before[0], len(store), store.bytes

    stored, left, size = asyncio.run(run())
    assert stored == 1 and left == 0 and size == 0


def test_zero_max_stored_keeps_nothing():
    store, _ = make(max_stored=0)
    assert put(store, "a") is False
    assert store.get("a", owner=None) is None and len(store) == 0


def test_delete():
    store, _ = make()
    put(store, "a")
    assert store.delete("a", owner=None) is True
    assert store.delete("a", owner=None) is False
    assert store.get("a", owner=None) is None


def test_a_lower_max_stored_shrinks_the_store_at_once():
    store, limits = make()
    for rid in "abc":
        put(store, rid)
    limits.set(max_stored=1)
    put(store, "d")
    assert len(store) == 1 and store.get("d", owner=None) is not None
