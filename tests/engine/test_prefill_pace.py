"""A long prefill takes steps of bounded time, so a decoding row keeps getting tokens.

``[batch] prefill_step_seconds`` shrinks each step's prefill chunk below
``prefill_step_size`` to fit a time budget. The baseline is the same run
with the budget off, in the same test: there a 1,000-token prompt is
prefilled in one chunk, and the row decoding beside it waits for all of it.
"""

from __future__ import annotations

import pytest

from mlxd.engine.chat.batch import BatchLane
from tests.support.engine import run_all, running_engine, token_request

LONG = 1000


def _steps_beside_the_prefill(engine, monkeypatch, tokenizer) -> tuple[int, int]:
    """Steps that gave the short row a token while the long one prefilled, and its tokens."""
    beside: list[int] = []
    step = BatchLane.step

    def counting_step(self):
        prefilling = any(r.id == "long" and r.first_token_mono is None for r in self.rows.values())
        outs = step(self)
        if prefilling and any(o.row.id == "short" for o in outs):
            beside.append(1)
        return outs

    monkeypatch.setattr(BatchLane, "step", counting_step)
    text = "The river runs past the old mill every morning, and so on. " * 200
    long_ids = tokenizer.encode(text)[:LONG]
    short, long = run_all(
        engine,
        [token_request("short", long_ids[:24], 48), token_request("long", long_ids, 2)],
    )
    assert short.ok and long.ok
    monkeypatch.setattr(BatchLane, "step", step)
    return len(beside), len(short.tokens)


@pytest.mark.parametrize("family", ["llama"])
def test_a_time_budget_lets_decoding_rows_step_during_a_long_prefill(
    family, monkeypatch, tiny_models, tiny_loaded
):
    _, tokenizer = tiny_loaded(family)
    counts = {}
    for seconds in (0.0, 0.001):
        with running_engine(
            tiny_models(family),
            batch={"size": 4, "prefill_step_size": 1024, "prefill_step_seconds": seconds},
            prompt_cache={"disk": False},
        ) as engine:
            counts[seconds] = _steps_beside_the_prefill(engine, monkeypatch, tokenizer)
    (off, off_tokens), (on, on_tokens) = counts[0.0], counts[0.001]
    assert off <= 1  # one chunk held the whole prompt: nothing beside it
    # A 1 ms budget cuts it into chunks of 32+ tokens: the short row decodes between them
    # (as long as it has tokens left to make).
    assert on >= min(5, on_tokens - 1), (off, on, on_tokens)
    assert on_tokens >= 6 and off_tokens == on_tokens
