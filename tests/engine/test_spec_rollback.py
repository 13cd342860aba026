"""A verify step's per-row rollback leaves every cache family as plain one-token steps would.

Two copies of one batch (rows of 5, 12 and 21 prompt tokens, merged as the
batch lane merges rows with history) read the same token sequences: one a
token per step, the other in verify steps of 1 to 4 positions in which each
row keeps its own random count (ragged), with plain one-token steps in
between (so a sliding window wraps and rotates between verify steps). The
logits of every kept position match the one-token path's, and so do the
rows' caches at the end: the recurrent states of Qwen3-Next / Qwen3.5 /
Mamba-2 / Falcon-H1, the sliding window of Gemma 3 (window 16, passed), and
the quantized KV of ``kv_bits``.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache

from mlxd.engine.chat.quant_cache import fresh_cache
from mlxd.engine.chat.speculative.rollback import begin, can_roll_back, leaves
from tests.support.tinymodels import KV_QUANT_FAMILY

PROMPTS = (5, 12, 21)
LENGTH = 30  # tokens each row reads after its prompt


def batch_cache(model, kv_quant):
    rows = []
    for i, n in enumerate(PROMPTS):
        cache = fresh_cache(model, kv_quant)
        prompt = mx.array([[(7 * i + 3 * t) % 300 + 10 for t in range(n)]])
        model(prompt, cache=cache)
        rows.append(cache)
    merged = _merge_caches(rows)
    mx.eval([c.state for c in leaves(merged)])
    return merged


def row_arrays(cache, i):
    """What row ``i`` holds in one layer cache, comparable across batch layouts."""
    if isinstance(cache, ArraysCache):
        return [a[i] for a in cache.cache if a is not None]
    row = cache.extract(i)
    if isinstance(cache, BatchRotatingKVCache):  # the window every next token sees
        keep = cache.max_size - 1
        return [row.keys[..., -keep:, :], row.values[..., -keep:, :], mx.array(row.offset)]
    return [*tree_flatten((row.keys, row.values)), mx.array(row.offset)]


def tree_flatten(tree):
    if isinstance(tree, (tuple, list)):
        return [a for t in tree for a in tree_flatten(t)]
    return [tree]


def plain_step(model, cache, seq, pos):
    tokens = mx.array([[seq[i][p]] for i, p in enumerate(pos)])
    return model(tokens, cache=cache)[:, 0]


@pytest.mark.parametrize(
    "family", ["qwen3_next", "qwen3_5", "gemma3_text", "mamba2", "falcon_h1", KV_QUANT_FAMILY]
)
def test_ragged_verify_steps_match_one_token_steps(family, tiny_loaded):
    model, _ = tiny_loaded(family)
    kv_quant = (8, 64) if family == KV_QUANT_FAMILY else None
    rng = random.Random(family)
    seq = [[rng.randrange(10, 400) for _ in range(LENGTH)] for _ in PROMPTS]
    padded = mx.array([row + [0] * LENGTH for row in seq])
    reference_cache = batch_cache(model, kv_quant)
    reference = mx.stack(
        [plain_step(model, reference_cache, seq, [t] * len(PROMPTS)) for t in range(LENGTH)],
        axis=1,
    )

    cache = batch_cache(model, kv_quant)
    pos = [0] * len(PROMPTS)
    ragged = step = 0
    while max(pos) + 4 <= LENGTH:
        step += 1
        if step % 3 == 0:
            logits = plain_step(model, cache, seq, pos)
            for i, p in enumerate(pos):
                assert mx.allclose(logits[i], reference[i, p], atol=1e-4).item(), (step, i)
            pos = [p + 1 for p in pos]
            continue
        width = rng.randint(2, 4)
        kept = [rng.randint(1, width) for _ in pos]
        if step % 3 == 2:  # every row drops the same count (a trim), then a plain step
            kept = [rng.randint(1, width - 1)] * len(pos)
        verify(model, cache, padded, reference, pos, width, kept)
        ragged += len(set(kept)) > 1
        pos = [p + k for p, k in zip(pos, kept, strict=True)]
    assert ragged > 3
    # The last step brings every row to the end; then the rows' caches are the same.
    verify(model, cache, padded, reference, pos, LENGTH - min(pos), [LENGTH - p for p in pos])
    for mine, theirs in zip(leaves(cache), leaves(reference_cache), strict=True):
        for i in range(len(PROMPTS)):
            for a, b in zip(row_arrays(mine, i), row_arrays(theirs, i), strict=True):
                assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item(), (type(mine), i)


def verify(model, cache, padded, reference, pos, width, kept):
    assert can_roll_back(model, cache)
    rows = mx.stack([padded[i, p : p + width] for i, p in enumerate(pos)])
    with begin(model, cache, width) as tx:
        logits = model(rows, cache=cache)
    tx.commit(kept)
    for i, (p, k) in enumerate(zip(pos, kept, strict=True)):
        got, want = logits[i, :k], reference[i, p : p + k]
        assert mx.allclose(got, want, atol=1e-4).item(), (i, p, k, width)


def test_a_recurrent_cache_of_a_family_without_recording_hooks_does_not_speculate(tiny_loaded):
    model, _ = tiny_loaded("qwen3_next")
    cache = batch_cache(model, None)
    assert can_roll_back(model, cache)
    # A model that is no mlx-lm module tree (a vision model's language model through
    # mlx-vlm), over the same caches: its recurrence cannot be recorded.
    assert not can_roll_back(type("NotMlxLm", (), {})(), cache)
    cache[0].lengths = mx.array([1, 1, 1])  # mid-prefill, right-padded
    assert not can_roll_back(model, cache)
