"""KV projection and the admission rule (pure).

The numbers follow mlx-lm's allocation rules (docs/batching.md, "The
projection"); ``tests/engine/test_kv_budget.py`` checks the same projection
against a real ``BatchGenerator`` after every step.
"""

from __future__ import annotations

import pytest

from mlxd.engine.policy.admission import (
    KV_STEP,
    CacheLayout,
    HitPlan,
    LayerLayout,
    RowExtent,
    alone_bytes,
    auto_budget,
    check_admission,
    lone_capacity,
    never_fits,
    plan_hit,
    project_batch_bytes,
    row_extent,
    shared_capacity,
    stepped,
)

FULL = LayerLayout("full", bytes_per_token=100)
WINDOW = LayerLayout("window", bytes_per_token=100, window=64)
STATE = LayerLayout("state", state_bytes=5000)
GiB = 1024**3
SLACK = KV_STEP - 1


def test_stepped_rounds_up_to_256():
    assert [stepped(n) for n in (0, 1, 255, 256, 257, 512, 513)] == [
        0,
        256,
        256,
        256,
        512,
        512,
        768,
    ]


def test_row_extent_uses_decode_allowance_not_max_tokens():
    assert row_extent(100, 10_000, 500) == RowExtent(100, 500)
    assert row_extent(100, 20, 500) == RowExtent(100, 20)
    assert row_extent(100, 20, 500).tokens == 120


def test_row_extent_leaves_at_least_one_prompt_token_to_prefill():
    assert row_extent(100, 20, 500, cached=100).cached == 99
    assert row_extent(100, 20, 500, cached=-3).cached == 0


@pytest.mark.parametrize(
    ("extent", "step", "capacity"),
    [
        # No prefix: the cache grows on the 256 grid from 0.
        (RowExtent(10, 100), 512, 256),
        (RowExtent(300, 0), 512, 512),
        (RowExtent(200, 56), 512, 256),
        (RowExtent(200, 57), 512, 512),
        # A 300-token prefix arrives as a 300-slot array; growth adds steps from there.
        (RowExtent(301, 1, cached=300), 512, 300 + KV_STEP),
        (RowExtent(310, 5, cached=300), 512, 300 + KV_STEP),
        # A prefix on a step boundary keeps the grid.
        (RowExtent(600, 100, cached=512), 512, 768),
        # Chunks of 300 grow from the position where the cache ran out:
        # 300 -> 512; 599 > 512 -> 300 + 512 = 812; then the decode fits.
        (RowExtent(600, 100, cached=0), 300, 812),
        # Chunks of 512 (2 steps each) from a 100-token prefix: 612, 1124, then decode.
        (RowExtent(1200, 0, cached=100), 512, 1124 + KV_STEP),
    ],
)
def test_lone_capacity_replays_mlx_lm_growth(extent, step, capacity):
    assert lone_capacity(extent, step) == capacity


def test_full_attention_grows_per_token_in_steps():
    layout = CacheLayout((FULL, FULL))
    assert alone_bytes(layout, RowExtent(10), 512) == 2 * 256 * 100
    assert alone_bytes(layout, RowExtent(257), 512) == 2 * 512 * 100


def test_a_shared_batch_pays_its_longest_row_plus_less_than_a_step_of_spare_capacity():
    rows = [RowExtent(10, prefilling=False), RowExtent(40), RowExtent(300)]
    assert shared_capacity(rows, 512, 8) == 300 + SLACK
    # three rows of 10, 40 and 300 tokens hold 3 x (300 + spare), not a sum of rows
    got = project_batch_bytes(CacheLayout((FULL,)), rows, 512, prompt_concurrency=8)
    assert got == 3 * (300 + SLACK) * 100


def test_rows_prefilled_from_mixed_prefixes_pay_the_longest_prompt_plus_a_chunk():
    # A conversation with a 300-token cached prefix joins next to a fresh 300-token
    # prompt: the prompt batch holds both at 300 + 299 tokens for a round.
    cached = RowExtent(310, 5, cached=300)
    fresh = RowExtent(300, 5)
    assert shared_capacity([cached, fresh], 512, 8) == 310 + 300 + SLACK
    # Once one of them decodes, only the rows still prefilling share a position.
    assert shared_capacity([cached, RowExtent(300, 5, prefilling=False)], 512, 8) == 315 + SLACK
    # The chunk is at most one prefill step.
    long = RowExtent(2000, 5)
    assert shared_capacity([cached, long], 512, 8) == 2000 + 512 + SLACK


def test_rows_starting_level_stay_level_but_a_row_joining_a_prefill_under_way_may_not():
    a, b = RowExtent(2000, 5), RowExtent(1000, 5)
    assert shared_capacity([a, b], 512, 8) == 2005 + SLACK
    # More rows than one prompt batch takes: the rest join while it runs.
    assert shared_capacity([a, b], 512, 1) == 2000 + 512 + SLACK
    # ``a`` has prefilled 1536 tokens when ``b`` joins: b runs a chunk ahead of a's end.
    started = RowExtent(2000, 5, prefilled=1536)
    assert shared_capacity([started, b], 512, 8) == 2000 + 512 + SLACK


def test_a_lone_row_is_projected_exactly():
    layout = CacheLayout((FULL,))
    row = RowExtent(300, 10)
    assert project_batch_bytes(layout, [row], 512, lone=True) == 512 * 100
    assert project_batch_bytes(layout, [row], 512) == (310 + SLACK) * 100
    # ``lone`` only applies to one row.
    two = project_batch_bytes(layout, [row, row], 512, lone=True, prompt_concurrency=8)
    assert two == 2 * (310 + SLACK) * 100


def test_window_layers_cap_at_window_plus_one_prefill_chunk():
    layout = CacheLayout((WINDOW,))
    assert alone_bytes(layout, RowExtent(10_000), 32) == (64 + 32) * 100
    assert alone_bytes(layout, RowExtent(20), 32) == min(256, 96) * 100
    assert project_batch_bytes(layout, [RowExtent(20), RowExtent(20)], 32) == 2 * 96 * 100


def test_state_layers_are_constant_per_row():
    layout = CacheLayout((STATE,))
    assert alone_bytes(layout, RowExtent(1), 512) == 5000
    assert project_batch_bytes(layout, [RowExtent(100_000)] * 3, 512) == 3 * 5000


def test_hybrid_layout_sums_its_layer_kinds():
    layout = CacheLayout((FULL, WINDOW, STATE))
    rows = [RowExtent(1000, prefilling=False), RowExtent(5)]
    got = project_batch_bytes(layout, rows, 16)
    assert got == 2 * (1000 + SLACK) * 100 + 2 * (64 + 16) * 100 + 2 * 5000
    assert layout.kinds == ("full", "state", "window")


def test_empty_batch_costs_nothing():
    assert project_batch_bytes(CacheLayout((FULL,)), [], 512) == 0


def admit(running, candidate, *, size=8, budget=10**9, real=0):
    return check_admission(
        CacheLayout((FULL,)),
        running,
        candidate,
        batch_size=size,
        budget=budget,
        real_bytes=real,
        prefill_step_size=512,
        prompt_concurrency=8,
    )


def test_admits_when_slot_and_budget_allow():
    a = admit([RowExtent(10, prefilling=False)], RowExtent(10))
    assert a.admit and a.waiting_for is None and a.projected_bytes == 2 * (10 + SLACK) * 100


def test_the_first_row_of_an_empty_batch_is_projected_alone():
    a = admit([], RowExtent(10), budget=256 * 100)
    assert a.admit and a.projected_bytes == 256 * 100


def test_batch_full_waits():
    a = admit([RowExtent(10)] * 2, RowExtent(10), size=2)
    assert (a.admit, a.waiting_for) == (False, "batch_full")


def test_projection_over_budget_waits_and_exactly_at_budget_admits():
    budget = 2 * (10 + SLACK) * 100
    assert admit([RowExtent(10)], RowExtent(10), budget=budget).admit
    a = admit([RowExtent(10)], RowExtent(10), budget=budget - 1)
    assert (a.admit, a.waiting_for) == (False, "budget")


def test_a_long_candidate_makes_every_row_pay():
    # Fits by a sum of rows, not by the shared capacity.
    budget = 256 * 100 + 1024 * 100
    a = admit([RowExtent(10)], RowExtent(1000), budget=budget)
    assert not a.admit and a.projected_bytes == 2 * (1000 + SLACK) * 100


def test_real_bytes_past_budget_stop_admission():
    a = admit([RowExtent(10)], RowExtent(10), budget=10**6, real=10**6 + 1)
    assert (a.admit, a.waiting_for) == (False, "budget")


def test_never_fits_reports_the_projection():
    layout = CacheLayout((FULL,))
    assert never_fits(layout, RowExtent(100), 256 * 100, 512) is None
    assert never_fits(layout, RowExtent(300), 256 * 100, 512) == 512 * 100


def test_fifo_head_blocks_smaller_followers():
    """The admission rule is asked about the head only: a blocked head blocks the queue."""
    running = [RowExtent(100, prefilling=False)]
    queue = [RowExtent(2000), RowExtent(10)]
    budget = 2 * (100 + SLACK) * 100
    admitted = []
    for candidate in queue:
        if not admit(running, candidate, budget=budget).admit:
            break
        admitted.append(candidate)
    assert admitted == []
    assert admit(running, queue[1], budget=budget).admit  # would fit, but waits its turn


# The wedge: a 401-token prompt (60 to generate) fits 600 slots on its own
# (512), but with a 400-token cached prefix it needs 400 + 256 = 656.
WEDGE = RowExtent(401, 60, cached=400)
SLOTS_600 = 600 * 100


def test_a_hit_that_fits_is_kept():
    layout = CacheLayout((FULL,))
    plan = plan_hit(layout, WEDGE, 700 * 100, 512, trimmable=True)
    assert plan == HitPlan(400)


def test_a_hit_that_never_fits_is_cut_back_to_a_step_boundary():
    layout = CacheLayout((FULL,))
    assert alone_bytes(layout, WEDGE, 512) > SLOTS_600
    plan = plan_hit(layout, WEDGE, SLOTS_600, 512, trimmable=True)
    assert plan == HitPlan(256)
    assert lone_capacity(RowExtent(401, 60, cached=256), 512) == 512


def test_an_untrimmable_hit_that_never_fits_is_dropped():
    plan = plan_hit(CacheLayout((FULL,)), WEDGE, SLOTS_600, 512, trimmable=False)
    assert plan == HitPlan(0)


def test_a_short_hit_is_dropped_rather_than_cut_to_nothing():
    row = RowExtent(200, 100, cached=100)  # 100 + 256 = 356 slots; bare: 512
    assert plan_hit(CacheLayout((FULL,)), row, 340 * 100, 512, trimmable=True) == HitPlan(
        0, refused=512 * 100
    )
    row = RowExtent(150, 100, cached=100)  # 100 + 256 = 356 slots; bare: 256
    assert plan_hit(CacheLayout((FULL,)), row, 340 * 100, 512, trimmable=True) == HitPlan(0)


def test_a_request_that_fits_no_way_is_refused_with_its_bare_projection():
    plan = plan_hit(CacheLayout((FULL,)), WEDGE, 500 * 100, 512, trimmable=True)
    assert plan == HitPlan(0, refused=512 * 100)


def test_auto_budget_subtracts_weights_cache_and_headroom():
    device = 24 * GiB
    got = auto_budget(device, weights_bytes=GiB, prompt_cache_bytes=GiB)
    assert got == device - GiB - GiB - device // 5
    assert auto_budget(2 * GiB, weights_bytes=2 * GiB, prompt_cache_bytes=0) == 64 * 1024**2
