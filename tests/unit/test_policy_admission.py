"""KV projection and the admission rule (pure)."""

from __future__ import annotations

from mlxd.engine.policy.admission import (
    KV_STEP,
    CacheLayout,
    LayerLayout,
    RowExtent,
    auto_budget,
    check_admission,
    never_fits,
    project_batch_bytes,
    row_capacity,
    row_extent,
    stepped,
)

FULL = LayerLayout("full", bytes_per_token=100)
WINDOW = LayerLayout("window", bytes_per_token=100, window=64)
STATE = LayerLayout("state", state_bytes=5000)
GiB = 1024**3


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
    assert row_extent(100, 10_000, 500) == RowExtent(600)
    assert row_extent(100, 20, 500) == RowExtent(120)


def test_row_capacity_with_a_cached_prefix_starts_exact_then_steps():
    assert row_capacity(RowExtent(300)) == 512
    # A 300-token prefix arrives as a 300-slot array; one more token adds a step.
    assert row_capacity(RowExtent(301, cached=300)) == 300 + KV_STEP


def test_full_attention_grows_per_token_in_steps():
    layout = CacheLayout((FULL, FULL))
    assert project_batch_bytes(layout, [RowExtent(10)], 512) == 2 * 256 * 100
    assert project_batch_bytes(layout, [RowExtent(257)], 512) == 2 * 512 * 100


def test_batch_shares_the_longest_rows_capacity():
    layout = CacheLayout((FULL,))
    rows = [RowExtent(10), RowExtent(40), RowExtent(300)]
    # three rows of 10, 40 and 300 tokens hold 3 x 512 slots, not 256 + 256 + 512
    assert project_batch_bytes(layout, rows, 512) == 3 * 512 * 100


def test_window_layers_cap_at_window_plus_one_prefill_chunk():
    layout = CacheLayout((WINDOW,))
    assert project_batch_bytes(layout, [RowExtent(10_000)], 32) == (64 + 32) * 100
    assert project_batch_bytes(layout, [RowExtent(20)], 32) == min(256, 96) * 100


def test_state_layers_are_constant_per_row():
    layout = CacheLayout((STATE,))
    assert project_batch_bytes(layout, [RowExtent(1)], 512) == 5000
    assert project_batch_bytes(layout, [RowExtent(100_000)] * 3, 512) == 3 * 5000


def test_hybrid_layout_sums_its_layer_kinds():
    layout = CacheLayout((FULL, WINDOW, STATE))
    got = project_batch_bytes(layout, [RowExtent(1000), RowExtent(5)], 16)
    assert got == 2 * 1024 * 100 + 2 * (64 + 16) * 100 + 2 * 5000
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
    )


def test_admits_when_slot_and_budget_allow():
    a = admit([RowExtent(10)], RowExtent(10))
    assert a.admit and a.waiting_for is None and a.projected_bytes == 2 * 256 * 100


def test_batch_full_waits():
    a = admit([RowExtent(10)] * 2, RowExtent(10), size=2)
    assert (a.admit, a.waiting_for) == (False, "batch_full")


def test_projection_over_budget_waits_and_exactly_at_budget_admits():
    budget = 2 * 256 * 100
    assert admit([RowExtent(10)], RowExtent(10), budget=budget).admit
    a = admit([RowExtent(10)], RowExtent(10), budget=budget - 1)
    assert (a.admit, a.waiting_for) == (False, "budget")


def test_a_long_candidate_makes_every_row_pay():
    # Fits by a sum of rows, not by the shared capacity.
    budget = 256 * 100 + 1024 * 100
    a = admit([RowExtent(10)], RowExtent(1000), budget=budget)
    assert not a.admit and a.projected_bytes == 2 * 1024 * 100


def test_real_bytes_past_budget_stop_admission():
    a = admit([RowExtent(10)], RowExtent(10), budget=10**6, real=10**6 + 1)
    assert (a.admit, a.waiting_for) == (False, "budget")


def test_never_fits_reports_the_projection():
    layout = CacheLayout((FULL,))
    assert never_fits(layout, RowExtent(100), 256 * 100, 512) is None
    assert never_fits(layout, RowExtent(300), 256 * 100, 512) == 512 * 100


def test_fifo_head_blocks_smaller_followers():
    """The admission rule is asked about the head only: a blocked head blocks the queue."""
    running = [RowExtent(100)]
    queue = [RowExtent(2000), RowExtent(10)]
    budget = 2 * 256 * 100
    admitted = []
    for candidate in queue:
        if not admit(running, candidate, budget=budget).admit:
            break
        admitted.append(candidate)
    assert admitted == []
    assert admit(running, queue[1], budget=budget).admit  # would fit, but waits its turn


def test_auto_budget_subtracts_weights_cache_and_headroom():
    device = 24 * GiB
    got = auto_budget(device, weights_bytes=GiB, prompt_cache_bytes=GiB)
    assert got == device - GiB - GiB - device // 5
    assert auto_budget(2 * GiB, weights_bytes=2 * GiB, prompt_cache_bytes=0) == 64 * 1024**2
