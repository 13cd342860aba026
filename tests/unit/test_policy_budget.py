"""The KV budget in effect and the key a refusal names (pure)."""

from __future__ import annotations

from mlxd.engine.policy.budget import KvRoom, PoolRoom, kv_room

MiB = 1024**2
GiB = 1024**3
WHAT = "This request (100 prompt tokens + 50 to generate)"


def test_without_a_shared_pool_the_batch_key_binds():
    room = kv_room(600 * 1024, auto_bytes=0, pool=None)
    assert (room.bytes, room.binds) == (600 * 1024, "kv_budget")
    message = room.over(655 * 1024, WHAT)
    assert message.startswith(WHAT + " needs about 655 KiB of KV cache")
    assert "[batch] kv_budget (600 KiB)" in message and "raise [batch] kv_budget" in message


def test_auto_names_what_auto_subtracted():
    room = kv_room("auto", auto_bytes=3 * GiB, pool=None)
    assert (room.bytes, room.binds) == (3 * GiB, "auto")
    message = room.over(4 * GiB, WHAT)
    assert '3.0 GiB that [batch] kv_budget = "auto" leaves' in message
    assert "set [batch] kv_budget to a size" in message


def test_a_kv_budget_within_the_pool_binds_itself():
    pool = PoolRoom(budget=8 * GiB, reserved=2 * GiB, cache_cap=GiB)
    room = kv_room(GiB, auto_bytes=0, pool=pool)
    assert (room.bytes, room.binds) == (GiB, "kv_budget")
    assert room.cause(2 * GiB) == "[batch] kv_budget"


def test_the_pool_binds_when_it_leaves_less_than_kv_budget_or_auto():
    pool = PoolRoom(budget=8 * GiB, reserved=7 * GiB, cache_cap=MiB)
    assert kv_room(2 * GiB, auto_bytes=0, pool=pool) == KvRoom(GiB, "memory", pool)
    assert kv_room("auto", auto_bytes=0, pool=pool) == KvRoom(GiB, "memory", pool)


def test_the_memory_budget_is_named_when_weights_leave_no_room():
    # Other models' weights: shrinking this model's small prompt cache would not help.
    pool = PoolRoom(budget=64 * MiB, reserved=80 * MiB, cache_cap=8 * MiB)
    room = kv_room("auto", auto_bytes=0, pool=pool)
    assert room.bytes == 0
    message = room.over(256 * 1024, WHAT)
    assert room.cause(256 * 1024) == "[memory] budget"
    # Issue 22: not "a KV budget of 0 B", but what over-commits the budget and what to do.
    assert "[memory] budget (64.0 MiB) is over-committed" in message and "0 B" not in message
    assert "reserve 80.0 MiB" in message and "Raise [memory] budget" in message
    assert "unpin or unload a model" in message and "kv_budget" not in message


def test_a_short_memory_budget_names_the_room_it_leaves():
    pool = PoolRoom(budget=64 * MiB, reserved=63 * MiB, cache_cap=8 * MiB)
    message = kv_room("auto", auto_bytes=0, pool=pool).over(10 * MiB, WHAT)
    assert "more than the 1.0 MiB of KV room that [memory] budget (64.0 MiB) leaves" in message
    assert "raise [memory] budget or unload other models" in message


def test_the_prompt_cache_key_is_named_when_its_reservation_takes_the_room():
    # The case: a 1 GiB prompt cache in a 64 MiB budget.
    pool = PoolRoom(budget=64 * MiB, reserved=GiB + MiB, cache_cap=GiB)
    key = "[models.a.prompt_cache] max_bytes"
    room = kv_room("auto", auto_bytes=0, pool=pool, keys=("[batch] kv_budget", key))
    assert room.cause(256 * 1024) == key
    message = room.over(256 * 1024, WHAT)
    assert f"1.0 GiB of it for this model's prompt cache ({key})" in message
    assert f"lower {key}" in message and "kv_budget" not in message


def test_a_models_own_budget_key_is_named():
    room = kv_room(
        MiB,
        auto_bytes=0,
        pool=None,
        keys=("[models.a.batch] kv_budget", "[prompt_cache] max_bytes"),
    )
    assert "raise [models.a.batch] kv_budget" in room.over(2 * MiB, WHAT)
