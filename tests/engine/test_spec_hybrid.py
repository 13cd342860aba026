"""A hybrid model's speculating rows leave the prompt cache what plain decoding leaves.

Qwen3-Next's rows keep recurrent states, which a verify step records per
position and commits per row (``speculative/rollback.py``). A wrong state
would not show in the row's own output only: the prompt cache stores the
finished row's cache and the next turn starts from it. So: four rows draft
from an oracle (the answer speculation off gave, one token of every third
draft wrong, so rows accept different counts in one step), the stored caches
are compared with speculation off's (states within 1e-4), and a next turn of
every conversation hits those entries and answers as off does.
"""

from __future__ import annotations

import numpy as np

from mlxd.engine.chat.prompt_cache import Kind, PromptCache, detach
from mlxd.engine.chat.speculative.speculator import Speculator
from mlxd.engine.messages import Finished
from tests.engine.test_speculative import TEXTS
from tests.engine.test_speculative import formula_costs as formula_costs  # autouse fixture
from tests.support.engine import run_all, running_engine, settled, token_request

FAMILY = "qwen3_next"
MAX_TOKENS = 16


def stored_caches(monkeypatch) -> dict[tuple[int, ...], list[np.ndarray]]:
    """Every finished row's stored cache, as numpy arrays, by its tokens."""
    stored: dict[tuple[int, ...], list[np.ndarray]] = {}
    store = PromptCache.store

    def recording(self, tokens, cache, live_bytes, kind: Kind = "assistant"):
        if cache is not None and tokens and kind == "assistant":
            arrays = [a for c in detach(cache) for a in _flat(c.state)]
            stored[tuple(tokens)] = [np.array(a) for a in arrays]
        return store(self, tokens, cache, live_bytes, kind)

    monkeypatch.setattr(PromptCache, "store", recording)
    return stored


def _flat(state):
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _flat(s)]
    return [state] if hasattr(state, "shape") else []


def oracle(monkeypatch, expected: dict[tuple[int, ...], list[int]]) -> None:
    calls = [0]

    def draft(self, uid, tokens, pending, k):
        prompt = max((p for p in expected if tuple(tokens[: len(p)]) == p), key=len)
        done = len(tokens) - len(prompt) + 1
        out = list(expected[prompt][done : done + k])
        calls[0] += 1
        if out and calls[0] % 3 == 0:
            out[(uid + calls[0]) % len(out)] = (out[(uid + calls[0]) % len(out)] + 1) % 500
        return out

    monkeypatch.setattr(Speculator, "_draft", draft)


def conversation(model_dir, first, second_of, mode):
    """Both turns of every conversation in one engine; outputs and counters per turn."""
    spec = {"mode": mode, "saturation_tokens": 100_000}
    with running_engine(
        model_dir, batch={"size": 4, "prompt_concurrency": 4}, speculative=spec
    ) as engine:
        one = run_all(engine, first)
        counters = dict(settled(engine).counters)
        two = run_all(engine, second_of(one))
        state = settled(engine)
    return one, two, counters, state


def test_stored_hybrid_caches_and_the_next_turn_equal_speculation_off(
    tiny_models, tiny_loaded, monkeypatch
):
    model_dir = tiny_models(FAMILY)
    _, tokenizer = tiny_loaded(FAMILY)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    first = [token_request(f"a{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
    tail = tokenizer.encode(" and then again:")

    def second_of(one):
        return [
            token_request(f"b{i}", [*p, *o.tokens, *tail], MAX_TOKENS)
            for i, (p, o) in enumerate(zip(prompts, one, strict=True))
        ]

    stored = stored_caches(monkeypatch)
    one_off, two_off, _, _ = conversation(model_dir, first, second_of, "off")
    off_caches = dict(stored)
    stored.clear()
    expected = {tuple(p): o.tokens for p, o in zip(prompts, one_off, strict=True)}
    expected |= {
        (*p, *o.tokens, *tail): t.tokens for p, o, t in zip(prompts, one_off, two_off, strict=True)
    }
    oracle(monkeypatch, expected)
    one_on, two_on, counters, state = conversation(model_dir, first, second_of, "prompt_lookup")

    assert [o.tokens for o in one_on] == [o.tokens for o in one_off]
    assert 0 < counters["spec_accepted_tokens"] < counters["spec_drafted_tokens"]
    assert set(stored) == set(off_caches) and len(stored) == 2 * len(TEXTS)
    for tokens, arrays in stored.items():
        theirs = off_caches[tokens]
        assert [a.shape for a in arrays] == [b.shape for b in theirs]
        for a, b in zip(arrays, theirs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4)
    assert [o.tokens for o in two_on] == [o.tokens for o in two_off]
    ends = [o.end for o in two_on]
    assert all(isinstance(e, Finished) and e.lookup and e.lookup.source == "ram" for e in ends)
    assert state.counters["spec_accepted_tokens"] > counters["spec_accepted_tokens"]
