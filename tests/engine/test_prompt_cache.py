"""The prompt cache on every cache family, both lanes: checkpoints hit, and change nothing.

A first prompt is prefilled with checkpoints every ``EVERY`` tokens and at
its end; then a second turn (the first prompt plus more) and an edited
prompt (the first one changed in the middle) must start from the stored
prefix — for caches that cannot be rewound (recurrent state, sliding
windows, both) from a checkpoint — and generate, greedy and float32, exactly
what a cold prefill of the same prompt generates with mlx-lm alone.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine.messages import Finished
from tests.support.engine import greedy_reference, run_all, running_engine, token_request

FAMILIES = ["llama", "gemma3_text", "qwen3_next", "qwen3_5", "mamba2", "falcon_h1"]
EVERY = 64
MAX_TOKENS = 16
FIRST = 300
EDIT_AT = 200


def first_prompt(tokenizer) -> list[int]:
    text = "The river runs past the old mill every morning, and the people walk along. " * 30
    ids = tokenizer.encode(text)
    assert len(ids) >= FIRST
    return ids[:FIRST]


def cold(model, tokenizer, ids: list[int]) -> list[int]:
    return greedy_reference(model, tokenizer, ids, MAX_TOKENS)


@pytest.mark.parametrize("lane", ["batch", "serial"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_restored_checkpoint_generates_what_a_cold_prefill_does(
    family, lane, tiny_models, tiny_loaded
):
    model, tokenizer = tiny_loaded(family)
    first = first_prompt(tokenizer)
    size = 4 if lane == "batch" else 1
    with running_engine(
        tiny_models(family),
        batch={"size": size},
        prompt_cache={"checkpoint_every": EVERY, "disk": False},
    ) as engine:
        rewindable = set(engine.snapshot().model.cache_kinds) == {"full"}
        (warm,) = run_all(engine, [token_request("first", first, MAX_TOKENS)])
        # Continuations that leave the first prompt (and its answer) exactly there.
        turn2 = first + [t for t in range(50, 60) if t not in warm.tokens[:1]][:6]
        edit = [t for t in range(60, 70) if t != first[EDIT_AT]][:4]
        edited = first[:EDIT_AT] + edit + first[EDIT_AT + 4 : EDIT_AT + 40]
        (second,) = run_all(engine, [token_request("turn2", turn2, MAX_TOKENS)])
        (third,) = run_all(engine, [token_request("edited", edited, MAX_TOKENS)])
        snap = engine.snapshot()
    expected = [cold(model, tokenizer, p) for p in (turn2, edited)]
    assert warm.ok and second.ok and third.ok
    assert {o.accepted.lane for o in (warm, second, third)} == {lane}  # type: ignore[union-attr]
    assert [second.tokens, third.tokens] == expected

    assert isinstance(second.end, Finished) and isinstance(third.end, Finished)
    hit2, hit3 = second.end.usage.cached_tokens, third.end.usage.cached_tokens
    if rewindable:  # a KVCache is cut back to the common prefix
        assert (hit2, hit3) == (FIRST, EDIT_AT)
    else:  # the checkpoint at the first prompt's end; the last one before the edit
        assert (hit2, hit3) == (FIRST - 1, EDIT_AT // EVERY * EVERY)
        assert snap.prompt_cache.checkpoints >= FIRST // EVERY + 1
    for out, at in ((second, FIRST), (third, EDIT_AT)):
        assert out.admitted is not None and out.admitted_first
        lookup = out.admitted.lookup
        assert out.end.lookup == lookup  # type: ignore[union-attr]
        assert lookup.source == "ram" and lookup.cached_tokens == out.end.usage.cached_tokens  # type: ignore[union-attr]
        assert lookup.diverged_at == at
        assert lookup.before and lookup.after
    assert snap.lookups[0].request_id == "edited" and snap.lookups[0].lookup == third.end.lookup
    assert snap.prompt_cache.ram_tokens == hit2 + hit3


def _state(n: int):
    from mlx_lm.models.cache import ArraysCache

    cache = ArraysCache(1)
    cache[0] = mx.full((1, 4), float(n))
    return [cache]


def test_eviction_keeps_the_shared_system_prefix_longest():
    from mlxd.config import PromptCacheSettings
    from mlxd.engine.chat.prompt_cache import PromptCache

    cache = PromptCache(PromptCacheSettings(max_entries=3, disk=False))
    system = list(range(100))
    assert cache.store(system, _state(0), 0, "system")
    for turn in range(1, 6):  # a conversation: its prompt's end, then its answer
        prompt = [*system, *range(1000, 1000 + 10 * turn)]
        cache.store(prompt, _state(turn), 0, "user")
        cache.store([*prompt, 7, 7], _state(-turn), 0, "assistant")
    # A new conversation with the same system prompt still finds it.
    fetched = cache.fetch([*system, 5, 5])
    assert len(cache) == 3 and fetched.source == "ram"
    assert fetched.cache is not None and fetched.cache[0][0].tolist() == [[0.0] * 4]
    # So is the last answer: the conversation goes on from it.
    last = [*system, *range(1000, 1050), 7, 7, 1, 2]
    assert len(last) - len(cache.fetch(last).rest) == len(last) - 2
