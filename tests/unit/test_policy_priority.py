"""The priority rules (mlxd.engine.policy.priority): classes, fair share, aging, preemption."""

from __future__ import annotations

import itertools

import pytest

from mlxd.engine.policy.priority import (
    CLASSES,
    Rules,
    Running,
    Waiting,
    capped,
    effective,
    order,
    rank,
    victim,
)

NO_AGING = Rules(fair_share=True, aging_s=0)
FIFO = Rules(fair_share=False, aging_s=0)


def w(priority: str, key: str, seq: int, queued_at: float = 0.0, resumed: bool = False):
    return Waiting(priority, key, seq, queued_at, resumed)


def ids(items, running=None, now=0.0, rules=NO_AGING, served=None):
    return [items[i].seq for i in order(items, running or {}, now, rules, served)]


def test_classes_are_ordered_most_urgent_first():
    assert [rank(c) for c in CLASSES] == [0, 1, 2, 3]
    assert CLASSES == ("high", "normal", "low", "batch")
    assert rank("nonsense") == rank("normal")


@pytest.mark.parametrize(
    ("asked", "ceiling", "runs"),
    [
        (None, "high", "high"),
        (None, "low", "low"),
        ("low", "high", "low"),
        ("normal", "high", "normal"),
        ("high", "low", "low"),  # never above the key's class
        ("high", "normal", "normal"),
        ("batch", "high", "batch"),
        ("bogus", "normal", "normal"),
    ],
)
def test_a_request_may_lower_its_class_never_raise_it(asked, ceiling, runs):
    assert capped(asked, ceiling) == runs


def test_fifo_without_fair_share_within_a_class():
    items = [w("normal", "a", 0), w("normal", "a", 1), w("normal", "b", 2), w("normal", "a", 3)]
    assert ids(items, rules=FIFO) == [0, 1, 2, 3]


def test_classes_go_first_whatever_the_arrival_order():
    items = [w("low", "a", 0), w("normal", "a", 1), w("batch", "a", 2), w("high", "a", 3)]
    for rules in (FIFO, NO_AGING):
        assert ids(items, rules=rules) == [3, 1, 0, 2]


def test_a_flood_of_one_key_lets_another_key_in_at_its_first_turn():
    flood = [w("normal", "flood", i) for i in range(6)]
    single = w("normal", "single", 6)
    got = ids([*flood, single])
    # turns: flood 0..5, single 0; ties by arrival: flood#0 then single.
    assert got == [0, 6, 1, 2, 3, 4, 5]
    assert got.index(6) <= 2


def test_rows_already_running_count_against_their_keys_turn():
    items = [w("normal", "flood", i) for i in range(1, 6)] + [w("normal", "single", 6)]
    assert ids(items, running={"flood": 1}) == [6, 1, 2, 3, 4, 5]


def test_keys_alternate_one_row_at_a_time_the_least_recently_served_first():
    # Batch size 1: nothing runs when the next request is chosen; the key served
    # last waits for the others' turn.
    items = [w("normal", "flood", i) for i in range(1, 6)] + [w("normal", "single", 6)]
    assert ids(items, served={"flood": 10.0})[0] == 6
    assert ids(items, served={"flood": 10.0, "single": 11.0})[0] == 1
    # Without fair share, serving history changes nothing.
    assert ids(items, rules=FIFO, served={"flood": 10.0})[0] == 1


def test_a_flood_served_one_at_a_time_lets_the_other_key_in_second():
    queue = [w("normal", "flood", i) for i in range(6)] + [w("normal", "single", 6)]
    served: dict[str, float] = {}
    ran = []
    for t in range(len(queue)):
        first = order(queue, {}, 0.0, NO_AGING, served)[0]
        item = queue.pop(first)
        served[item.key] = float(t)
        ran.append(item.seq)
    assert ran.index(6) <= 1, ran
    assert [s for s in ran if s != 6] == [0, 1, 2, 3, 4, 5]


def test_round_robin_across_three_keys_fifo_within_each():
    items = [w("normal", k, i) for i, k in enumerate("aaabbc")]
    got = ids(items)
    assert got == [0, 3, 5, 1, 4, 2]
    for key in "abc":  # each key's own requests keep their order
        mine = [s for s in got if items[s].key == key]
        assert mine == sorted(mine)


def test_fair_share_never_crosses_classes():
    items = [w("low", "b", 0), w("normal", "a", 1), w("normal", "a", 2), w("normal", "a", 3)]
    assert ids(items) == [1, 2, 3, 0]


def test_a_preempted_row_goes_back_to_the_head_of_its_class_only():
    items = [
        w("low", "a", 1),
        w("low", "b", 2),
        w("low", "a", 5, resumed=True),
        w("high", "c", 9),
    ]
    # Fair share: the resumed row counts as key a's turn, so b's request comes next.
    assert ids(items) == [9, 5, 2, 1]
    assert ids(items, rules=FIFO) == [9, 5, 1, 2]


def test_aging_lifts_one_class_per_period_never_above_high():
    rules = Rules(aging_s=10)
    assert effective(w("low", "a", 0, queued_at=100), 105, rules) == rank("low")
    assert effective(w("low", "a", 0, queued_at=100), 110, rules) == rank("normal")
    assert effective(w("low", "a", 0, queued_at=100), 125, rules) == rank("high")
    assert effective(w("batch", "a", 0, queued_at=0), 10_000, rules) == rank("high")
    assert effective(w("low", "a", 0, queued_at=0), 10_000, Rules(aging_s=0)) == rank("low")


def test_an_old_low_request_goes_before_fresh_normal_ones():
    rules = Rules(aging_s=30)
    items = [w("normal", "a", 5, queued_at=95), w("low", "b", 1, queued_at=60)]
    assert ids(items, now=100, rules=rules) == [1, 5]
    assert ids(items, now=80, rules=rules) == [5, 1]


def test_low_priority_never_starves_under_a_steady_stream_of_high():
    # Each tick one request runs and a new high arrives: the low one still runs.
    rules = Rules(aging_s=5)
    queue = [w("low", "low", 0, queued_at=0)]
    seq = itertools.count(1)
    ran = []
    for tick in range(40):
        queue.append(w("high", "hi", next(seq), queued_at=tick))
        first = order(queue, {}, float(tick), rules)[0]
        ran.append(queue.pop(first).seq)
        if 0 in ran:
            break
    assert 0 in ran and len(ran) <= 12


def test_order_is_a_permutation():
    items = [w(c, k, i) for i, (c, k) in enumerate(itertools.product(CLASSES, "xyz"))]
    for rules in (FIFO, NO_AGING, Rules(aging_s=1)):
        got = order(items, {"x": 2}, 3.0, rules)
        assert sorted(got) == list(range(len(items)))


def test_the_victim_is_the_least_urgent_most_recently_started_row():
    rows = [Running("low", 1.0), Running("normal", 5.0), Running("low", 3.0), Running("batch", 0.5)]
    assert victim("high", rows) == 3  # batch is the least urgent
    assert victim("high", rows[:3]) == 2  # among the lows, the one that started last
    assert victim("normal", rows[:3]) == 2
    assert victim("low", rows[:3]) is None  # only a less urgent row yields


def test_no_victim_among_equals_or_unpreemptible_rows():
    assert victim("normal", [Running("normal", 1.0)]) is None
    assert victim("high", [Running("high", 1.0)]) is None
    assert victim("high", [Running("low", 1.0, preemptible=False)]) is None
    assert victim("high", [Running("low", 1.0, preemptible=False), Running("low", 0.0)]) == 1
    assert victim("high", []) is None
