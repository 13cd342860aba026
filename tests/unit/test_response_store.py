"""The Responses store: bounded by count and by age, with a fake clock."""

from __future__ import annotations

from mlxd.api.responses.store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, rid: str, *, max_stored: int = 3, ttl: float = 60.0) -> bool:
    return store.put(
        rid, {"id": rid}, ({"role": "user", "content": rid},), max_stored=max_stored, ttl=ttl
    )


def test_oldest_is_evicted_beyond_max_stored():
    store = ResponseStore(Clock())
    for rid in "abcd":
        assert put(store, rid)
    assert len(store) == 3
    assert store.get("a", ttl=60) is None
    assert [store.get(r, ttl=60).body["id"] for r in "bcd"] == ["b", "c", "d"]
    assert store.get("d", ttl=60).messages == ({"role": "user", "content": "d"},)


def test_expired_entries_are_gone():
    clock = Clock()
    store = ResponseStore(clock)
    put(store, "a")
    clock.now += 30
    put(store, "b")
    clock.now += 31  # a is 61 s old, b 31 s
    assert store.get("a", ttl=60) is None
    assert store.get("b", ttl=60) is not None
    assert len(store) == 1
    # A shorter ttl (a reload) applies at once.
    assert store.get("b", ttl=10) is None


def test_zero_max_stored_keeps_nothing():
    store = ResponseStore(Clock())
    assert put(store, "a", max_stored=0) is False
    assert store.get("a", ttl=60) is None and len(store) == 0


def test_delete():
    store = ResponseStore(Clock())
    put(store, "a")
    assert store.delete("a", ttl=60) is True
    assert store.delete("a", ttl=60) is False
    assert store.get("a", ttl=60) is None


def test_a_lower_max_stored_shrinks_the_store_on_the_next_put():
    store = ResponseStore(Clock())
    for rid in "abc":
        put(store, rid)
    put(store, "d", max_stored=1)
    assert len(store) == 1 and store.get("d", ttl=60) is not None
