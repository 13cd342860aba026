"""When a refused request counts as stalled (pure)."""

from __future__ import annotations

from mlxd.engine.policy.stalls import STALL_PASSES, STALL_SECONDS, StallWatch


def run(watch: StallWatch, ids: list[str | None], dt: float) -> list[bool]:
    return [watch.observe(i, n * dt) for n, i in enumerate(ids)]


def test_a_head_refused_on_an_idle_lane_for_a_few_passes_and_half_a_second_is_stalled():
    got = run(StallWatch(), ["a"] * (STALL_PASSES + 2), STALL_SECONDS)
    assert got.index(True) == STALL_PASSES - 1
    assert all(got[STALL_PASSES - 1 :])


def test_many_fast_passes_are_not_enough_without_the_time():
    dt = STALL_SECONDS / (10 * STALL_PASSES)
    got = run(StallWatch(), ["a"] * (5 * STALL_PASSES), dt)
    assert not any(got)
    assert run(StallWatch(), ["a"] * (20 * STALL_PASSES), dt)[-1]


def test_a_pass_that_is_not_stuck_or_another_head_starts_over():
    watch = StallWatch()
    ids = ["a"] * (STALL_PASSES - 1) + [None] + ["a"] * (STALL_PASSES - 1)
    assert not any(run(watch, ids, STALL_SECONDS))
    watch = StallWatch()
    ids = ["a"] * (STALL_PASSES - 1) + ["b"] * (STALL_PASSES - 1)
    assert not any(run(watch, ids, STALL_SECONDS))
