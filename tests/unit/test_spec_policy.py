"""Speculation's pure parts: the prompt-lookup index and the depth cost model."""

from __future__ import annotations

import pytest

from mlxd.engine.chat.speculative.lookup import NgramIndex
from mlxd.engine.policy.spec_depth import (
    PRIOR,
    Acceptance,
    StepCosts,
    choose_depth,
    expected_tokens,
    step_cost,
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
    assert choose_depth(8, 4, 0.6, 64, costs) == choose_depth(8, 4, 0.6, 64)
    costs.record(8, 1, 0.10)
    for width in range(2, 6):  # a compute-bound machine: every extra token costs fully
        costs.record(8, width, 0.10 * width)
    assert costs.ratio(8, 5) == pytest.approx(5.0)
    assert choose_depth(8, 4, 0.6, 64, costs) == 0
    assert choose_depth(4, 4, 0.6, 64, costs) == choose_depth(4, 4, 0.6, 64) > 0  # not measured
    costs.record(8, 1, 0.20)  # a moving average: one slow step moves it part of the way
    assert 0.10 < costs.seconds[(8, 1)] < 0.20
