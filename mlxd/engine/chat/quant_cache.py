"""Quantized KV caches for both lanes: ``[batch] kv_bits`` (docs/batching.md, "Quantized KV").

mlx-lm 0.32 quantizes a single sequence's cache (``QuantizedKVCache``) but has
no quantized ``BatchKVCache``. This module adds both forms, kept in step:

- :class:`QuantKVCache`: one row's cache (mlx-lm's ``QuantizedKVCache`` plus
  ``merge`` into a batch, ``size`` and an ``nbytes`` that counts an empty cache);
  the serial lane and the prompt cache's entries hold it.
- :class:`BatchQuantKVCache`: the batch's cache, a ``BatchKVCache`` whose keys
  and values are (packed values, scales, biases) triples. It does what the
  generator asks of a batch cache: ``merge``, ``extend``, ``filter``,
  ``prepare``/``finalize`` (right padding), ``trim`` and ``extract``.

Both store every token quantized the moment it is written. A decode step (one
token) attends with mlx-lm's quantized attention; a prefill chunk (more than
one token) attends over the *dequantized* keys and values instead (the
``bits`` attribute that selects mlx-lm's quantized path is hidden for that
call): the quantized path materializes the chunk x context score matrix,
which raised peak memory above full precision (mlx-lm #1587), while the
dequantized copy is one layer's keys and values, freed layer by layer.
Either way attention reads the same quantized values.

Only full-attention ``KVCache`` layers are quantized; sliding-window
(``RotatingKVCache``) and recurrent (``ArraysCache``) layers keep full
precision. :func:`fresh_cache` builds a row's cache; :func:`register` makes
``load_prompt_cache`` (the disk tier) know the class. Engine thread only (MLX).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import (
    BatchKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
    make_prompt_cache,
)

Triple = tuple[mx.array, mx.array, mx.array]
_STEP = 256


def _dequantize(q: Any, group_size: int, bits: int) -> mx.array:
    return mx.dequantize(*q, group_size=group_size, bits=bits)


def _nbytes(*triples: Any) -> int:
    return sum(a.nbytes for t in triples if t is not None for a in t)


class QuantKVCache(QuantizedKVCache):
    """One sequence's quantized cache; a prefill chunk attends in full precision."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        self._chunk = False
        super().__init__(group_size=group_size, bits=bits)

    # mlx-lm's attention takes its quantized path when the cache has ``bits``:
    # hidden while the last update was a prefill chunk (it got full precision).
    @property
    def bits(self) -> int:
        if getattr(self, "_chunk", False):
            raise AttributeError("bits")
        return self._bits

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = value

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self._chunk = False
        k, v = super().update_and_fetch(keys, values)
        if keys.shape[2] == 1:
            return k, v
        self._chunk = True
        g, b = self.group_size, self._bits
        return _dequantize(k, g, b), _dequantize(v, g, b)

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.group_size, self._bits

    @state.setter
    def state(self, v: Any) -> None:
        # load_prompt_cache gives the triples back as lists.
        self._chunk = False
        keys, values, self.offset, self.group_size, self._bits = v
        self.keys = tuple(keys) if keys is not None else None
        self.values = tuple(values) if values is not None else None

    def size(self) -> int:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.offset

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantKVCache:
        return BatchQuantKVCache.merge(caches)


class BatchQuantKVCache(BatchKVCache):
    """A batch of left-padded rows whose keys and values are stored quantized."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self._bits = bits
        self._chunk = False
        self.keys: Any = None
        self.values: Any = None

    @property
    def bits(self) -> int:
        if self._chunk:
            raise AttributeError("bits")
        return self._bits

    def _length(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        prev, n = self._idx, keys.shape[2]
        g, b = self.group_size, self._bits
        if self.keys is None or prev + n > self._length():
            batch, heads = keys.shape[:2]
            steps = (_STEP + n - 1) // _STEP * _STEP

            def grow(old: Triple | None, like: Triple) -> Triple:
                new = tuple(mx.zeros((batch, heads, steps, a.shape[-1]), a.dtype) for a in like)
                if old is None:
                    return new  # type: ignore[return-value]
                if prev % _STEP != 0:
                    old = tree_map(lambda a: a[..., :prev, :], old)
                return tuple(mx.concatenate([o, z], axis=2) for o, z in zip(old, new, strict=True))  # type: ignore[return-value]

            qk = mx.quantize(keys, group_size=g, bits=b)
            qv = mx.quantize(values, group_size=g, bits=b)
            self.keys, self.values = grow(self.keys, qk), grow(self.values, qv)
        else:
            qk = mx.quantize(keys, group_size=g, bits=b)
            qv = mx.quantize(values, group_size=g, bits=b)
        self.offset = self.offset + n
        self._idx += n
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        k, v = self.keys_and_values()
        self._chunk = n > 1
        if self._chunk:
            return _dequantize(k, g, b), _dequantize(v, g, b)
        return k, v

    def keys_and_values(self) -> Any:
        return tree_map(lambda a: a[..., : self._idx, :], (self.keys, self.values))

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = tree_map(
                lambda a: dynamic_roll(a, padding[:, None], axis=2), (self.keys, self.values)
            )
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda a: a[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(cast(list[int], self.left_padding.tolist()))
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda a: a[..., shift:, :], (self.keys, self.values)
                )
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: Any) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(self._length(), other._length())
        like = self if self.keys is not None else other

        def pad(c: Any) -> tuple[Any, Any, mx.array, mx.array]:
            rows = c.offset.shape[0]
            out = []
            for mine, ref in ((c.keys, like.keys), (c.values, like.values)):
                if mine is None:
                    mine = tuple(mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype) for a in ref)
                left = idx - c._idx
                right = size - mine[0].shape[2] - left
                if right < 0:
                    mine = tuple(a[..., :right, :] for a in mine)
                    right = 0
                if left or right:
                    mine = tuple(mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]) for a in mine)
                out.append(mine)
            return out[0], out[1], c.offset, c.left_padding + (idx - c._idx)

        a, b = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([x, y]) for x, y in zip(a[0], b[0], strict=True))
        self.values = tuple(mx.concatenate([x, y]) for x, y in zip(a[1], b[1], strict=True))
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = idx

    def extract(self, idx: int) -> QuantKVCache:  # pyright: ignore[reportIncompatibleMethodOverride]
        cache = QuantKVCache(self.group_size, self._bits)
        mx.eval(self.left_padding)
        pad = cast(list[int], self.left_padding.tolist())[idx]
        cache.keys, cache.values = tree_map(
            lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]), (self.keys, self.values)
        )
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantKVCache:
        first = caches[0]
        group, bits = first.group_size, first._bits
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group, bits)
        padding = [longest - n for n in lengths]
        ref = next(c for c in caches if c.keys is not None)

        def stack(part: str) -> Triple:
            like = getattr(ref, part)
            out = tuple(
                mx.zeros((len(caches), a.shape[1], longest, a.shape[3]), a.dtype) for a in like
            )
            for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
                mine = getattr(c, part)
                if mine is None:
                    continue
                for o, a in zip(out, mine, strict=True):
                    o[i : i + 1, :, p : p + c.offset] = a[..., : c.offset, :]
            return out  # type: ignore[return-value]

        cache = cls(padding, group, bits)
        cache.keys, cache.values = stack("keys"), stack("values")
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values)


def quantize_caches(caches: list[Any], group_size: int, bits: int) -> list[Any]:
    """``caches``, every empty full-attention ``KVCache`` now a :class:`QuantKVCache`."""
    out: list[Any] = []
    for c in caches:
        if isinstance(c, CacheList):
            c.caches = tuple(quantize_caches(list(c.caches), group_size, bits))
            out.append(c)
        elif type(c) is KVCache and c.keys is None:
            out.append(QuantKVCache(group_size, bits))
        else:
            out.append(c)
    return out


def fresh_cache(model: Any, kv_quant: tuple[int, int] | None) -> list[Any]:
    """A new row's cache: ``make_prompt_cache``, quantized when ``kv_quant`` is (bits, group)."""
    caches = make_prompt_cache(model)
    if kv_quant is None:
        return caches
    bits, group = kv_quant
    return quantize_caches(caches, group, bits)


def register() -> None:
    """Let ``load_prompt_cache`` (it looks classes up by name in its module) rebuild ours."""
    setattr(mlx_cache, QuantKVCache.__name__, QuantKVCache)
