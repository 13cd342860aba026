"""BatchQuantKVCache does what BatchKVCache does, on quantized triples: merge, extend,
prepare/finalize (right padding), filter, trim and extract keep the same rows, offsets
and padding, and the dequantized keys match the full-precision ones to 8-bit error."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.engine.chat.quant_cache import BatchQuantKVCache, QuantKVCache


def _kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64))


def _pair(n: int, seed: int) -> tuple[KVCache, QuantKVCache]:
    full, quant = KVCache(), QuantKVCache(64, 8)
    if n:
        k, v = _kv(n, seed)
        full.update_and_fetch(k, v)
        quant.update_and_fetch(k, v)
    return full, quant


def _close(full: BatchKVCache, quant: BatchQuantKVCache) -> None:
    assert quant.left_padding.tolist() == full.left_padding.tolist()
    assert quant.offset.tolist() == full.offset.tolist()
    assert quant._idx == full._idx
    k_full, v_full = full.keys_and_values()
    k_q, v_q = quant.keys_and_values()
    for a, q in ((k_full, k_q), (v_full, v_q)):
        back = mx.dequantize(*q, group_size=64, bits=8)
        assert back.shape == a.shape
        # Padding slots: zeros in both; held slots: within 8-bit error of the value.
        assert float(mx.max(mx.abs(back - a)).item()) < 0.05


def test_the_quantized_batch_cache_follows_the_batch_cache_through_its_life():
    pairs = [_pair(n, s) for s, n in enumerate([5, 300, 0])]
    full = BatchKVCache.merge([f for f, _ in pairs])
    quant = QuantKVCache.merge([q for _, q in pairs])
    assert isinstance(quant, BatchQuantKVCache)
    _close(full, quant)
    # A prefill chunk with right padding: prepare, update, finalize.
    for c in (full, quant):
        c.prepare(lengths=[3, 1, 3], right_padding=[0, 2, 0])
    k, v = mx.random.normal((3, 2, 3, 64)), mx.random.normal((3, 2, 3, 64))
    full.update_and_fetch(k, v)
    out = quant.update_and_fetch(k, v)
    assert out[0].shape == (3, 2, full._idx, 64)  # a chunk attends in full precision
    assert not hasattr(quant, "bits")
    for c in (full, quant):
        c.finalize()
    _close(full, quant)
    # A decode step attends quantized.
    k, v = mx.random.normal((3, 2, 1, 64)), mx.random.normal((3, 2, 1, 64))
    full.update_and_fetch(k, v)
    out = quant.update_and_fetch(k, v)
    assert isinstance(out[0], tuple) and quant.bits == 8
    _close(full, quant)
    # A row joins, one leaves, the last token is trimmed.
    f_new, q_new = _pair(40, 9)
    full.extend(BatchKVCache.merge([f_new]))
    quant.extend(QuantKVCache.merge([q_new]))
    _close(full, quant)
    for c in (full, quant):
        c.filter([0, 2, 3])
        c.trim(1)
    _close(full, quant)
    # A row's cache comes out for the prompt cache: the same tokens, quantized.
    for i in range(3):
        one_full, one_q = full.extract(i), quant.extract(i)
        assert isinstance(one_q, QuantKVCache) and one_q.offset == one_full.offset
        assert one_q.keys is not None and one_full.keys is not None
        back = mx.dequantize(*one_q.keys, group_size=64, bits=8)
        assert float(mx.max(mx.abs(back - one_full.keys)).item()) < 0.05
    assert 0 < quant.nbytes < full.nbytes * 0.3


def test_an_empty_row_cache_counts_no_bytes_and_merges_empty():
    empty = QuantKVCache(64, 4)
    assert empty.nbytes == 0 and empty.size() == 0
    merged = QuantKVCache.merge([empty, QuantKVCache(64, 4)])
    assert merged.keys is None and merged.left_padding.tolist() == [0, 0]
    assert merged._bits == 4
