"""A prefill cancelled halfway keeps its work: the retry of the same prompt goes on from there.

An agent whose stream watchdog fires during a long cold prefill drops the
stream and sends the same prompt again (docs/agents.md). What the cancelled
row had prefilled, in whole chunks, is kept in the prompt cache, so the
retry starts from it and still generates exactly what a cold prefill does
(greedy, float32), in both lanes, for a cache that can be cut back (llama)
and one that cannot (qwen3_5's recurrent layers).
"""

from __future__ import annotations

import pytest

from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.serial import SerialRun
from mlxd.engine.messages import Failed, Finished
from tests.support.engine import greedy_reference, run_all, running_engine, settled, token_request

MAX_TOKENS = 6
PROMPT = 400
CHUNK = 32


def long_prompt(tokenizer) -> list[int]:
    ids = tokenizer.encode("The river runs past the old mill every morning, and so on. " * 40)
    assert len(ids) >= PROMPT
    return ids[:PROMPT]


def cold(model, tokenizer, ids: list[int]) -> list[int]:
    return greedy_reference(model, tokenizer, ids, MAX_TOKENS)


@pytest.mark.parametrize(
    ("family", "lane"), [("llama", "batch"), ("qwen3_5", "batch"), ("qwen3_5", "serial")]
)
def test_a_retry_goes_on_from_where_the_cancelled_prefill_stopped(
    family, lane, monkeypatch, tiny_models, tiny_loaded
):
    model, tokenizer = tiny_loaded(family)
    ids = long_prompt(tokenizer)
    seen: list[int] = []
    with running_engine(
        tiny_models(family),
        batch={"size": 4 if lane == "batch" else 1, "prefill_step_size": CHUNK},
        # No periodic checkpoints: what the retry finds is the cancelled row's work alone.
        prompt_cache={"checkpoint_every": 0, "disk": False},
    ) as engine:

        def cancel_halfway(row) -> None:
            # The client goes away halfway through the prefill (the engine
            # takes the cancel from its inbox before the next chunk).
            if row.id == "first" and row.prefill_done >= PROMPT // 2 and not seen:
                seen.append(row.prefill_done)
                engine.cancel("first")

        if lane == "batch":
            step = BatchLane.step

            def batch_step(self):
                for row in self.rows.values():
                    cancel_halfway(row)
                return step(self)

            monkeypatch.setattr(BatchLane, "step", batch_step)
        else:
            progress = SerialRun._progress

            def serial_progress(self, done, total):
                cancel_halfway(self.row)
                progress(self, done, total)

            monkeypatch.setattr(SerialRun, "_progress", serial_progress)
        (first,) = run_all(engine, [token_request("first", ids, MAX_TOKENS)])
        assert isinstance(first.end, Failed) and first.end.code == "cancelled"
        settled(engine)
        (retry,) = run_all(engine, [token_request("retry", ids, MAX_TOKENS)])
    assert seen and PROMPT // 2 <= seen[0] < PROMPT - CHUNK
    assert isinstance(retry.end, Finished) and retry.end.lookup is not None
    assert retry.accepted.lane == lane  # type: ignore[union-attr]
    # Every chunk prefilled before the cancel landed, and not the whole prompt.
    cached = retry.end.usage.cached_tokens
    assert retry.end.lookup.source == "ram"
    assert seen[0] <= cached < PROMPT - 1 and cached % CHUNK == 0
    assert retry.tokens == cold(model, tokenizer, ids)
