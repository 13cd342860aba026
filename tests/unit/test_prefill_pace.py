"""PrefillPace: the next prefill chunk fits the time budget, within the token cap."""

from __future__ import annotations

from mlxd.engine.chat.prefill_pace import FIRST_CHUNK, MIN_CHUNK, PrefillPace


def test_off_means_the_token_cap():
    pace = PrefillPace(512, 0.0)
    pace.observe(512, 10.0)
    assert pace.chunk() == 512


def test_the_first_chunk_is_small_then_the_chunk_fits_the_budget():
    pace = PrefillPace(4096, 0.25)
    assert pace.chunk() == FIRST_CHUNK
    pace.observe(128, 0.064)  # 0.5 ms a token
    assert pace.chunk() == 500
    # Deep into the prompt a token costs more: the next chunk shrinks at once.
    pace.observe(500, 1.0)
    assert pace.chunk() == 125


def test_a_cheaper_step_eases_in_and_the_bounds_hold():
    pace = PrefillPace(4096, 0.25)
    pace.observe(100, 0.1)  # 1 ms a token: 250
    pace.observe(20, 0.001)  # a short joiner alone, cheap: one step does not make it 4096
    assert 250 < pace.chunk() < 400
    pace.observe(10, 100.0)  # a token costs more than the budget: the floor
    assert pace.chunk() == MIN_CHUNK
    small = PrefillPace(16, 0.25)
    small.observe(16, 100.0)
    assert small.chunk() == 16  # never above the cap, even at the floor
    fast = PrefillPace(512, 0.25)
    fast.observe(512, 0.001)
    assert fast.chunk() == 512
    pace.observe(0, 1.0)  # nothing prefilled: nothing learnt
    pace.observe(5, 0.0)
    assert pace.chunk() == MIN_CHUNK
