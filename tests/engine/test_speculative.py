"""Speculative decoding in the batch lane gives greedy output token for token as without it.

Prompt lookup on tiny random models drafts little and is mostly rejected, so
most tests draft from an oracle instead: the output the same request gave
with speculation off, with one token of every third draft corrupted. That
makes rows accept different counts in one verify step (the ragged rollback),
accept whole drafts, and reject at once, all in one run.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxd.config import SpeculativeSettings
from mlxd.engine.chat.loading import ModelLoadError
from mlxd.engine.chat.speculative import speculator
from mlxd.engine.chat.speculative.drafter import Drafter, DraftModel, load_draft
from mlxd.engine.chat.speculative.speculator import Speculator
from mlxd.engine.constraints import json_constraint
from mlxd.engine.messages import Finished, SamplingParams
from mlxd.engine.policy.spec_depth import StepCosts
from tests.support.engine import run_all, running_engine, settled, token_request
from tests.support.tinymodels import KV_QUANT_FAMILY

MAX_TOKENS = 24
WIDE = {"saturation_tokens": 100_000}  # the cost model never cuts the depth here
TEXTS = [
    "The river runs past the old mill. The river runs past the old mill.",
    "A small computer reads a prompt, turns the words into numbers and predicts.",
    "Memory grows with every token the model keeps.",
    "one two three one two three one two",
]


@pytest.fixture(autouse=True)
def formula_costs(monkeypatch):
    """The cost model's formula only: step times measured on a shared CPU would vary."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, rows, width: None)


def requests(tokenizer, tag: str, **kw):
    out = [token_request(f"{tag}{i}", tokenizer.encode(t), MAX_TOKENS) for i, t in enumerate(TEXTS)]
    if kw:
        out[1] = token_request(f"{tag}1", tokenizer.encode(TEXTS[1]), MAX_TOKENS, **kw)
    return out


def oracle(
    monkeypatch, expected: dict[tuple[int, ...], list[int]], *, corrupt: bool = True
) -> list[int]:
    """Draft the known answer (one token of every third draft wrong); returns the call log."""
    calls = [0]

    def draft(self, uid, tokens, pending, k):
        prompt = next(p for p in expected if tuple(tokens[: len(p)]) == p)
        done = len(tokens) - len(prompt) + 1
        draft = list(expected[prompt][done : done + k])
        calls[0] += 1
        if corrupt and draft and calls[0] % 3 == 0:
            at = (uid + calls[0]) % len(draft)
            draft[at] = (draft[at] + 1) % 500
        return draft

    monkeypatch.setattr(Speculator, "_draft", draft)
    return calls


@contextlib.contextmanager
def full_depth(on: bool):
    """WIDE: every step drafts ``max_draft_tokens``. The cost model's measured step times
    (tests/unit/test_spec_policy.py) would make the depth depend on this machine's load."""
    if not on:
        yield
        return
    with (
        mock.patch.object(speculator, "choose_depth", lambda rows, max_depth, *_: max_depth),
        mock.patch.object(StepCosts, "wants_plain", lambda self, rows: False),
        mock.patch.object(speculator, "worth_verifying", lambda *_: True),
    ):
        yield


def run(model_dir, reqs, mode: str, batch=None, **spec):
    outs, counters = run_waves(model_dir, [reqs], mode, batch, **spec)
    return outs[0], counters[0]


def run_waves(model_dir, waves, mode: str, batch=None, **spec):
    """Each wave of requests after the last one ended, in one engine; counters after each."""
    outs, counters = [], []
    with (
        full_depth(spec == WIDE),
        running_engine(
            model_dir,
            batch={"size": 4, "prompt_concurrency": 4, **(batch or {})},
            speculative={"mode": mode, **spec},
        ) as engine,
    ):
        for reqs in waves:
            outs.append(run_all(engine, reqs))
            counters.append(dict(settled(engine).counters))
    return outs, counters


@pytest.mark.parametrize(
    ("family", "kv_bits"),
    [("llama", 0), ("qwen3_next", 0), ("gemma3_text", 0), (KV_QUANT_FAMILY, 8)],
)
def test_greedy_output_equals_speculation_off_solo_and_four_rows(
    family, kv_bits, tiny_models, tiny_loaded, monkeypatch
):
    model_dir = tiny_models(family)
    _, tokenizer = tiny_loaded(family)
    reqs = requests(tokenizer, "r")
    batch = {"kv_bits": kv_bits} if kv_bits else {}
    off, _ = run(model_dir, reqs, "off", batch=batch)
    expected = {tuple(tokenizer.encode(t)): o.tokens for t, o in zip(TEXTS, off, strict=True)}
    oracle(monkeypatch, expected)
    solo_req = token_request("solo", tokenizer.encode(TEXTS[0]), MAX_TOKENS)
    (four, solo), (counters, after) = run_waves(
        model_dir, [reqs, [solo_req]], "prompt_lookup", batch=batch, **WIDE
    )
    assert [o.tokens for o in four] == [o.tokens for o in off]
    assert solo[0].tokens == off[0].tokens
    ends = [o.end for o in four]
    assert all(isinstance(e, Finished) for e in ends)
    assert [e.usage.completion_tokens for e in ends if isinstance(e, Finished)] == [
        len(o.tokens) for o in off
    ]
    # Every cache family rolls back per row: rows speculate, accept some, reject some.
    assert 0 < counters["spec_accepted_tokens"] < counters["spec_drafted_tokens"]
    assert after["spec_accepted_tokens"] > counters["spec_accepted_tokens"]
    steps = counters["spec_verify_steps"]
    assert steps < sum(len(o.tokens) for o in off) / 4, "drafts were accepted in bulk"


def test_a_json_schema_row_a_logprobs_row_and_a_sampled_row_beside_a_speculating_row(
    tiny_models, tiny_loaded, monkeypatch
):
    model_dir = tiny_models("llama")
    _, tokenizer = tiny_loaded("llama")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    reqs = requests(tokenizer, "j", constraint=json_constraint(schema, strict=True, param="p"))
    reqs[2] = token_request(
        "j2", tokenizer.encode(TEXTS[2]), MAX_TOKENS, logprobs=True, top_logprobs=3
    )
    sampled = SamplingParams(temperature=0.8, top_p=0.9)  # rejection sampling (test_spec_sampled)
    reqs[3] = token_request("j3", tokenizer.encode(TEXTS[3]), MAX_TOKENS, sampling=sampled)
    off, _ = run(model_dir, reqs, "off")
    oracle(
        monkeypatch, {tuple(tokenizer.encode(t)): o.tokens for t, o in zip(TEXTS, off, strict=True)}
    )
    on, counters = run(model_dir, reqs, "prompt_lookup", **WIDE)
    assert [o.tokens for o in on[:3]] == [o.tokens for o in off[:3]]
    assert isinstance(on[3].end, Finished) and len(on[3].tokens) > 0
    assert counters["spec_accepted_tokens"] > 0
    lp_off = [lp for d in off[2].deltas for lp in d.logprobs]
    lp_on = [lp for d in on[2].deltas for lp in d.logprobs]
    assert len(lp_on) == len(lp_off) == len(off[2].tokens)
    for a, b in zip(lp_off, lp_on, strict=True):
        assert a.id == b.id and abs(a.logprob - b.logprob) < 1e-3
        assert [t.id for t in a.top] == [t.id for t in b.top]
        assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(a.top, b.top, strict=True))


def test_prompt_lookup_drafts_from_the_rows_own_tokens_and_a_reload_switches_it(
    tiny_models, tiny_loaded
):
    model_dir = tiny_models("llama")
    _, tokenizer = tiny_loaded("llama")
    reqs = requests(tokenizer, "p")
    spec = {"mode": "off", "ngram_min": 1, **WIDE}
    with running_engine(
        model_dir, batch={"size": 4, "prompt_concurrency": 4}, speculative=spec
    ) as engine:
        off = run_all(engine, reqs)
        assert settled(engine).counters["spec_verify_steps"] == 0
        on_settings = SpeculativeSettings(**{**spec, "mode": "prompt_lookup"})
        engine.apply(engine.settings.model_copy(update={"speculative": on_settings})).result(10)
        on = run_all(engine, requests(tokenizer, "q"))
        counters = settled(engine).counters
    assert [o.tokens for o in on] == [o.tokens for o in off]
    assert counters["spec_drafted_tokens"] > 0 and counters["spec_verify_steps"] > 0


def test_a_draft_model_identical_to_its_target_is_accepted_and_counted(tiny_models, tiny_loaded):
    model_dir = tiny_models("llama")
    _, tokenizer = tiny_loaded("llama")
    reqs = requests(tokenizer, "d")
    off, _ = run(model_dir, reqs, "off")
    spec = {"mode": "draft", "draft_model": str(model_dir), **WIDE}
    with running_engine(
        model_dir, batch={"size": 4, "prompt_concurrency": 4}, speculative=spec
    ) as engine:
        assert engine.info is not None
        weights = engine.info.weights_bytes
        on = run_all(engine, reqs)
        counters = settled(engine).counters
    target = tiny_loaded("llama")[0]
    arrays = [v for _, v in tree_flatten(target.parameters()) if isinstance(v, mx.array)]
    assert weights == 2 * sum(a.nbytes for a in arrays)
    assert [o.tokens for o in on] == [o.tokens for o in off]
    drafted, accepted = counters["spec_drafted_tokens"], counters["spec_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.8 * drafted, (accepted, drafted)


def test_a_draft_model_that_cannot_serve_is_refused_with_the_reason(tiny_models, tiny_loaded):
    _, tokenizer = tiny_loaded("llama")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_draft("/nonexistent/draft", tokenizer)
    with pytest.raises(ModelLoadError, match="cannot be cut back"):
        load_draft(str(tiny_models("qwen3_next")), tokenizer)


def test_a_rows_draft_cache_follows_its_tokens_after_a_rejection(tiny_loaded):
    model, tokenizer = tiny_loaded("llama")
    draft = DraftModel(model, "same", 0)
    prompt = tokenizer.encode(TEXTS[0])
    follows = Drafter(draft)
    first = follows.propose(7, prompt, 11, 4)
    # The target kept the first drafted token, then chose another: 12 (pending 13).
    tokens = [*prompt, 11, first[0], 12]
    assert follows.propose(7, tokens, 13, 4) == Drafter(draft).propose(7, tokens, 13, 4)
    # All accepted, then more plain steps: the cache catches up.
    again = follows.propose(7, tokens, 13, 3)
    tokens = [*tokens, 13, *again, 5, 6]
    assert follows.propose(7, tokens, 9, 3) == Drafter(draft).propose(7, tokens, 9, 3)


def test_stop_strings_and_max_tokens_cut_an_accepted_draft_where_off_stops(
    tiny_models, tiny_loaded, monkeypatch
):
    model_dir = tiny_models("llama")
    _, tokenizer = tiny_loaded("llama")
    free, _ = run(model_dir, requests(tokenizer, "f")[:1], "off")
    stop = tokenizer.decode(free[0].tokens[9:11])
    assert stop.strip() and stop not in tokenizer.decode(free[0].tokens[:9])
    reqs = requests(tokenizer, "s")
    reqs[0] = token_request("s0", tokenizer.encode(TEXTS[0]), MAX_TOKENS, stop=(stop,))
    reqs[3] = token_request("s3", tokenizer.encode(TEXTS[3]), 7)
    off, _ = run(model_dir, reqs, "off")
    oracle(
        monkeypatch,
        {
            tuple(tokenizer.encode(t)): free[0].tokens if i == 0 else o.tokens
            for i, (t, o) in enumerate(zip(TEXTS, off, strict=True))
        },
        corrupt=False,  # whole drafts accepted: the stop lands inside a step's tokens
    )
    on, counters = run(model_dir, reqs, "prompt_lookup", **WIDE)
    assert counters["spec_accepted_tokens"] > 0

    def seen(outs):
        return [(o.text, o.tokens, o.end.finish_reason, o.end.usage) for o in outs]

    assert seen(on) == seen(off)
    assert stop not in on[0].text and seen(on)[0][2] == "stop"
    assert len(on[3].tokens) == 7 and seen(on)[3][2] == "length"
