"""Speculation's pure parts: the prompt-lookup index and the depth cost model."""

from __future__ import annotations

import pytest

from mlxd.engine.chat.speculative.lookup import NgramIndex
from mlxd.engine.policy.spec_depth import (
    MARGIN,
    PRIOR,
    REFRESH,
    SATURATION_CPU,
    SATURATION_GPU,
    Acceptance,
    StepCosts,
    choose_depth,
    expected_tokens,
    fit_depth,
    step_cost,
    worth_verifying,
)


def index(tokens: list[int], lo: int = 1, hi: int = 3) -> NgramIndex:
    out = NgramIndex(lo, hi)
    out.extend(tokens)
    return out


def test_lookup_continues_the_most_recent_earlier_occurrence_of_the_longest_suffix():
    # suffix (2, 3) occurred twice before: after the later one came 9, 9
    assert index([1, 2, 3, 4, 5, 2, 3, 9, 9, 7, 2, 3]).propose(2) == [9, 9]
    # a longer suffix wins over a more recent shorter one
    assert index([5, 6, 7, 8, 1, 7, 0, 5, 6, 7]).propose(3) == [8, 1, 7]


def test_lookup_never_matches_the_suffix_itself_and_respects_the_minimum():
    assert index([1, 2, 3]).propose(4) == []
    assert index([4, 1, 2, 9, 2], lo=2).propose(3) == []  # only a 1-gram matches
    assert index([4, 1, 2, 9, 2], lo=1).propose(3) == [9, 2]


def test_a_longer_suffix_aligns_a_copy_with_its_place_in_the_prompt():
    # a list whose items share their tail: the 3-gram (1, 2, 3) last continued with 30,
    # the 4-gram ending in it says the copy is at the first item, followed by 20
    copy = [10, 1, 2, 3, 20, 1, 2, 3, 30, 5, 10, 1, 2, 3]
    assert index(copy, 2, 3).propose(2) == [30, 5]
    assert index(copy, 2, 6).propose(2) == [20, 1]


def test_lookup_grows_one_token_at_a_time_like_a_whole_build():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
    grown = NgramIndex(1, 3)
    for t in tokens:
        grown.extend([t])
        assert grown.propose(3) == index(grown.tokens).propose(3)


def test_a_draft_saves_work_only_when_accepted():
    assert expected_tokens(0, 0.9) == 1
    assert expected_tokens(3, 0.5) == pytest.approx(1.875)
    assert step_cost(4, 0, 64) == 1


def test_depth_falls_to_zero_as_the_batch_widens():
    depths = [choose_depth(rows, 4, 0.6, 64) for rows in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert depths == sorted(depths, reverse=True), depths
    assert depths[0] == 4 and depths[-1] == 0


def test_depth_follows_the_acceptance():
    assert choose_depth(1, 8, 0.0, 64) == 0
    assert choose_depth(1, 8, 0.9, 64) == 8
    assert choose_depth(8, 8, 0.3, 64) < choose_depth(8, 8, 0.8, 64)
    assert choose_depth(0, 4, 0.9, 64) == choose_depth(4, 0, 0.9, 64) == 0


def test_acceptance_is_measured_then_decays_back_to_the_prior():
    acceptance = Acceptance()
    assert acceptance.rate == PRIOR
    for _ in range(50):
        acceptance.record(4, 0)
    low = acceptance.rate
    assert low < 0.1
    for _ in range(300):
        acceptance.record(0, 0)
    assert low < acceptance.rate == pytest.approx(PRIOR, abs=0.05)


def test_measured_step_costs_replace_the_formula_for_their_rows():
    costs = StepCosts()
    assert costs.ratio(8, 5) is None
    assert choose_depth(8, 4, 0.6, 64) == 3
    assert choose_depth(8, 4, 0.6, 64, costs) == 1  # nothing measured yet: one deeper at most
    costs.record(8, 1, 0.10)
    for width in range(2, 6):  # a compute-bound machine: every extra token costs fully
        costs.record(8, width, 0.10 * width)
    assert costs.ratio(8, 5) == pytest.approx(5.0)
    assert choose_depth(8, 4, 0.6, 64, costs) == 0
    assert choose_depth(4, 4, 0.6, 64, costs) == 1  # not measured at 4 rows: explored
    costs.record(8, 1, 0.20)  # a moving average: one slow step moves it part of the way
    assert 0.10 < costs.seconds[(8, 1)] < 0.20


def test_a_cpu_prior_keeps_a_wide_batch_plain_from_its_first_step():
    for acceptance in (0.5, 0.7, 0.9):
        assert choose_depth(16, 4, acceptance, SATURATION_CPU, StepCosts()) == 0
    assert choose_depth(16, 4, 0.7, SATURATION_GPU, StepCosts()) == 1
    assert choose_depth(1, 4, 0.5, SATURATION_CPU, StepCosts()) == 1


def test_a_predicted_depth_must_beat_plain_by_the_margin_a_measured_one_need_not():
    # depth 1 at 32 rows and acceptance 0.5 on the GPU prior: 1.5 tokens for a cost of 1.4
    assert 1.0 < 1.5 / step_cost(32, 1, 64) < 1 + MARGIN
    assert choose_depth(32, 1, 0.5, 64, StepCosts()) == 0
    costs = StepCosts()
    costs.record(32, 1, 0.100)
    costs.record(32, 2, 0.140)
    assert choose_depth(32, 1, 0.5, 64, costs) == 1


def test_a_verify_step_dearer_than_the_prior_said_makes_deeper_ones_dearer_too():
    costs = StepCosts()
    costs.record(8, 1, 0.100)
    assert choose_depth(8, 4, 0.9, SATURATION_CPU, costs) == 1  # the prior: depth 3, explored
    costs.record(8, 2, 0.200)  # depth 1 cost 2x a plain step where the prior said 1.05 * 1.5
    assert costs.calibration(8, SATURATION_CPU) == pytest.approx(2.0 / step_cost(8, 1, 8))
    assert choose_depth(8, 4, 0.9, SATURATION_CPU, costs) == 0
    assert costs.calibration(4, SATURATION_CPU) == 1.0  # other widths keep the prior


def test_rows_that_always_speculated_want_a_plain_step_to_compare_with():
    costs = StepCosts()
    assert not costs.wants_plain(1)
    costs.record(1, 3, 0.1)
    assert costs.wants_plain(1) and not costs.wants_plain(2)
    costs.record(1, 1, 0.08)
    assert not costs.wants_plain(1)


def test_exploration_goes_one_deeper_per_measured_width():
    costs = StepCosts()
    depths = []
    for _ in range(5):
        depth = choose_depth(1, 4, 0.9, SATURATION_CPU, costs)
        depths.append(depth)
        costs.record(1, depth + 1, 0.1 * (1 + 0.1 * depth))
    assert depths == [1, 2, 3, 4, 4]


def test_a_slow_first_verify_step_does_not_keep_a_row_plain_for_good():
    costs = StepCosts()
    costs.record(1, 1, 0.10)
    costs.record(1, 2, 0.30)  # a cold first verify step: three plain steps' time
    assert choose_depth(1, 4, 0.9, 8, costs) == 0
    for _ in range(REFRESH - 1):
        costs.record(1, 1, 0.10)
    assert choose_depth(1, 4, 0.9, 8, costs) == 0  # still measured, still too dear
    costs.record(1, 1, 0.10)
    assert costs.deepest(1) == 0  # forgotten after REFRESH plain steps
    assert choose_depth(1, 4, 0.9, 8, costs) == 1  # explores again, one deep
    costs.record(1, 2, 0.12)
    assert costs.ratio(1, 2) == pytest.approx(1.2)
    assert choose_depth(1, 4, 0.9, 8, costs) >= 1


def test_memory_caps_the_depth_to_the_deepest_step_that_fits_the_room():
    def need(depth: int) -> int:
        return 100 * (depth + 1)

    assert fit_depth(4, None, need) == 4  # not capped
    assert fit_depth(4, 10_000, need) == 4
    assert fit_depth(4, 300, need) == 2
    assert fit_depth(4, 299, need) == 1
    assert fit_depth(4, 199, need) == 0  # nothing fits: a plain step
    assert fit_depth(0, 10_000, need) == 0


def test_a_step_is_priced_again_with_the_drafts_the_rows_really_made():
    """choose_depth assumes every row drafts; prompt lookup drafts for some. At four rows
    on the CPU prior, depth 2 pays when every row drafts and not when one row does."""
    a = 0.8
    assert choose_depth(4, 2, a, SATURATION_CPU) == 2
    assert worth_verifying([2, 2, 2, 2], a, SATURATION_CPU)
    assert not worth_verifying([2, 0, 0, 0], a, SATURATION_CPU)
    # the same arithmetic as the depth: rows' expected tokens over the width's cost
    tokens = expected_tokens(2, a) + expected_tokens(1, a) + 1
    assert worth_verifying([2, 1, 0], a, SATURATION_CPU) == (
        tokens / (3 * step_cost(3, 2, SATURATION_CPU)) > 1 + MARGIN
    )
    assert not worth_verifying([0, 0], a, SATURATION_CPU)
    assert not worth_verifying([], a, SATURATION_CPU)
    # one row alone drafting: what choose_depth would have said
    assert worth_verifying([3], 0.9, SATURATION_CPU) == (
        choose_depth(1, 3, 0.9, SATURATION_CPU) > 0
    )


def test_a_measured_width_prices_the_drafts_without_the_margin():
    costs = StepCosts()
    costs.record(4, 1, 0.100)
    costs.record(4, 3, 0.120)  # width 3 measured at 1.2x a plain step
    # two rows of four with depth-2 drafts at a = 0.5: (2 * 1.75 + 2) / 4 = 1.375 > 1.2
    assert worth_verifying([2, 2, 0, 0], 0.5, SATURATION_CPU, costs)
    # one row: (1.75 + 3) / 4 = 1.19 < 1.2
    assert not worth_verifying([2, 0, 0, 0], 0.5, SATURATION_CPU, costs)
