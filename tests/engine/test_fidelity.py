"""mlxd's lanes produce what mlx-lm produces, token for token, on every cache family.

The batched lane is compared with ``BatchGenerator`` given the same prompts in
the same order, the serial lane with ``stream_generate``; float32, greedy.
A second turn (each prompt + its answer + a follow-up) then starts from the
prompt cache (``cached_tokens`` = the whole first turn) and must still give
what a cold run gives.
"""

from __future__ import annotations

import pytest
from mlx_lm.generate import BatchGenerator

from tests.support.engine import greedy_reference, run_all, running_engine, token_request

FAMILIES = ["llama", "gemma3_text", "qwen3_next", "mamba2", "falcon_h1"]
MAX_TOKENS = 24
FOLLOW_UP = [40, 41, 42, 43]
TEXTS = [
    "The river runs past the old mill.",
    "A small computer reads a prompt, turns the words into numbers and predicts the next one. " * 3,
    "Memory grows with every token the model keeps. " * 14,
]


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


def oracle_batch(model, tokenizer, ids: list[list[int]]) -> list[list[int]]:
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        completion_batch_size=4,
        prefill_batch_size=4,
        prefill_step_size=512,
    )
    uids = gen.insert(ids, max_tokens=[MAX_TOKENS] * len(ids))
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


def oracle_serial(model, tokenizer, ids: list[int]) -> list[int]:
    return greedy_reference(model, tokenizer, ids, MAX_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_lane_matches_batch_generator(family, tiny_models, tiny_loaded):
    model, tokenizer = tiny_loaded(family)
    ids = prompts(tokenizer)
    expected = oracle_batch(model, tokenizer, ids)
    assert all(len(e) > 5 for e in expected), "the tiny model should generate for a while"
    follow = [p + e + FOLLOW_UP for p, e in zip(ids, expected, strict=True)]
    expected_follow = oracle_batch(model, tokenizer, follow)
    with running_engine(tiny_models(family), batch={"size": 4, "prompt_concurrency": 4}) as engine:
        first = run_all(engine, [token_request(f"b{i}", p, MAX_TOKENS) for i, p in enumerate(ids)])
        second = run_all(
            engine, [token_request(f"c{i}", p, MAX_TOKENS) for i, p in enumerate(follow)]
        )
    assert [o.accepted.lane for o in first + second] == ["batch"] * 6
    assert [o.tokens for o in first] == expected
    assert [o.tokens for o in second] == expected_follow
    assert first[0].end.usage.cached_tokens == 0
    turn = [len(p) + len(e) for p, e in zip(ids, expected, strict=True)]
    assert [o.end.usage.cached_tokens for o in second] == turn


@pytest.mark.parametrize("family", FAMILIES)
def test_serial_lane_matches_stream_generate(family, tiny_models, tiny_loaded):
    model, tokenizer = tiny_loaded(family)
    ids = prompts(tokenizer)
    expected = [oracle_serial(model, tokenizer, p) for p in ids]
    follow = [p + e + FOLLOW_UP for p, e in zip(ids, expected, strict=True)]
    expected_follow = [oracle_serial(model, tokenizer, p) for p in follow]
    with running_engine(tiny_models(family), batch={"size": 1}) as engine:
        first = run_all(engine, [token_request(f"s{i}", p, MAX_TOKENS) for i, p in enumerate(ids)])
        second = run_all(
            engine, [token_request(f"t{i}", p, MAX_TOKENS) for i, p in enumerate(follow)]
        )
    assert [(o.accepted.lane, o.accepted.reason) for o in first + second] == [
        ("serial", "mode")
    ] * 6
    assert [o.tokens for o in first] == expected
    assert [o.tokens for o in second] == expected_follow
    turn = [len(p) + len(e) for p, e in zip(ids, expected, strict=True)]
    assert [o.end.usage.cached_tokens for o in second] == turn


def test_seeded_request_reproduces_in_the_serial_lane(tiny_models):
    from mlxd.engine.messages import SamplingParams

    sampling = SamplingParams(temperature=1.0, seed=1234)
    with running_engine(tiny_models("llama"), batch={"size": 4}) as engine:
        a, b = (
            run_all(engine, [token_request(f"seed{i}", [5, 6, 7, 8, 9], 32, sampling=sampling)])[0]
            for i in range(2)
        )
        other = run_all(
            engine,
            [
                token_request(
                    "other", [5, 6, 7, 8, 9], 32, sampling=SamplingParams(temperature=1.0, seed=99)
                )
            ],
        )[0]
    assert (a.accepted.lane, a.accepted.reason) == ("serial", "seed")
    assert a.tokens == b.tokens and len(a.tokens) > 5
    assert other.tokens != a.tokens
