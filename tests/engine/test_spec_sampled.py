"""Sampled rows speculate by rejection sampling: the row's own distribution, drafts accepted.

The emitted tokens' distribution is checked on the acceptance rule itself
(thousands of independent trials in one call); in the engine, rows whose
distribution is a point mass (``top_k = 1``, a temperature of 1e-4) must give
the greedy output token for token while accepting drafts, and a seeded row
(the serial lane) stays reproducible with speculation on.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import pytest

from mlxd.engine.chat.speculative.rejection import accept, sampling_logits
from mlxd.engine.messages import Finished, SamplingParams
from mlxd.engine.policy.spec_depth import StepCosts
from tests.engine.test_speculative import MAX_TOKENS, TEXTS, WIDE, oracle, run_waves
from tests.support.engine import token_request

P = [0.5, 0.3, 0.15, 0.05]
TRIALS = 6000


@pytest.fixture(autouse=True)
def formula_costs(monkeypatch):
    """The cost model's formula only: step times measured on a shared CPU would vary."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, rows, width: None)


def emitted(s: SamplingParams, x: int) -> list[float]:
    """How often each token is emitted at a position whose draft is ``x`` (frequencies)."""
    mx.random.seed(3)
    logprobs = mx.log(mx.array([P] * (TRIALS + 1)))
    ok, candidates = accept(sampling_logits(logprobs, s), [x] * TRIALS)
    tokens = mx.where(ok, x, candidates[:TRIALS])
    counts = cast("list[int]", mx.stack([(tokens == t).sum() for t in range(len(P))]).tolist())
    return [c / TRIALS for c in counts]


@pytest.mark.parametrize(
    ("s", "want"),
    [
        (SamplingParams(temperature=1.0), P),
        (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0, 0]),
        (SamplingParams(temperature=1.0, top_p=0.7), [0.625, 0.375, 0, 0]),
        (SamplingParams(temperature=1.0, min_p=0.5), [0.625, 0.375, 0, 0]),
        (SamplingParams(temperature=0.5), [v / sum(q**2 for q in P) for v in (q**2 for q in P)]),
    ],
)
@pytest.mark.parametrize("x", [0, 2])
def test_the_emitted_token_follows_the_rows_distribution_whatever_was_drafted(s, want, x):
    got = emitted(s, x)
    assert all(abs(g - w) < 0.025 for g, w in zip(got, want, strict=True)), (got, want)


def test_point_mass_sampled_rows_speculate_and_give_the_greedy_output(
    tiny_models, tiny_loaded, monkeypatch
):
    model_dir = tiny_models("llama")
    _, tokenizer = tiny_loaded("llama")
    prompts = [tokenizer.encode(t) for t in TEXTS]
    greedy = [token_request(f"g{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
    (off,), _ = run_waves(model_dir, [greedy], "off")
    oracle(monkeypatch, {tuple(p): o.tokens for p, o in zip(prompts, off, strict=True)})
    point = [SamplingParams(temperature=0.8, top_k=1), SamplingParams(temperature=1e-4)]
    free = SamplingParams(temperature=0.8, top_p=0.9)
    seeded = SamplingParams(temperature=0.8, seed=11)

    def four(tag: str):
        kinds = [SamplingParams(), *point, free]
        return [
            token_request(f"{tag}{i}", p, MAX_TOKENS, sampling=s)
            for i, (p, s) in enumerate(zip(prompts, kinds, strict=True))
        ]

    solo = [
        [token_request(f"s{i}", prompts[i + 1], MAX_TOKENS, sampling=s)]
        for i, s in enumerate(point)
    ]
    twice = [[token_request(f"seed{i}", prompts[3], MAX_TOKENS, sampling=seeded)] for i in range(2)]
    outs, counters = run_waves(model_dir, [*solo, four("b"), *twice], "prompt_lookup", **WIDE)
    assert outs[0][0].tokens == off[1].tokens and outs[1][0].tokens == off[2].tokens
    assert [o.tokens for o in outs[2][:3]] == [o.tokens for o in off[:3]]
    assert isinstance(outs[2][3].end, Finished) and outs[2][3].tokens
    assert outs[3][0].tokens == outs[4][0].tokens  # a seed still gives the same text
    accepted = [c["spec_accepted_tokens"] for c in counters]
    assert 0 < accepted[0] < accepted[1] < accepted[2], accepted  # the sampled rows speculated
