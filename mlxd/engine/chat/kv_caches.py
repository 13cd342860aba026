"""Keeping mlx-lm's KV caches as large as admission projects them, and no larger.

Two gaps in mlx-lm 0.32 that make a cache hold more than its tokens need
(both would be fixed upstream by trimming to the offset before growing):

- a prompt-cache entry fetched for a shorter prompt is *trimmed* by moving
  its offset back; its arrays keep the stored entry's full length, so a copy
  of a 5,000-token conversation reused for its first 40 tokens still holds
  5,000 slots (in the pending queue, then in the generator's queue);
- ``KVCache`` / ``BatchKVCache.update_and_fetch`` only trims unused
  capacity before growing when the offset is not a multiple of the step,
  so a prompt batch whose position lands on a multiple of 256 with spare
  capacity left (after finished rows are filtered out) grows from the old
  capacity instead of from its position: up to a whole prefill chunk more.

:func:`compact` cuts a fetched cache to its offset; :func:`normalize` cuts
the spare capacity of a cache sitting on a step boundary before the next
prefill chunk. Both copy only what they keep (``mx.contiguous``), so the
bytes a cache reports are the bytes it holds. Engine thread only (MLX).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    trim_prompt_cache,
)

from mlxd.engine.chat.quant_cache import QuantKVCache

_STEP = 256
# One sequence's full-attention caches (a quantized one too: mlxd.engine.chat.quant_cache).
_SINGLE = (KVCache, QuantizedKVCache, QuantKVCache)


def _leaves(caches: Iterable[Any]) -> Iterator[Any]:
    for c in caches:
        if isinstance(c, CacheList):
            yield from _leaves(c.caches)
        else:
            yield c


def _slots(keys: Any) -> int:
    """The token slots of a cache's keys (a quantized cache's are a triple)."""
    return (keys[0] if isinstance(keys, tuple) else keys).shape[2]


def _cut(cache: Any, length: int) -> None:
    def cut(a: Any) -> Any:
        if isinstance(a, tuple):
            return tuple(mx.contiguous(x[..., :length, :]) for x in a)
        return mx.contiguous(a[..., :length, :])

    cache.keys, cache.values = cut(cache.keys), cut(cache.values)
    mx.eval(cache.keys, cache.values)


def compact(caches: list[Any] | None) -> None:
    """Drop the slots past the offset of every full-attention layer of a fetched cache."""
    if not caches:
        return
    for c in _leaves(caches):
        if type(c) in _SINGLE and c.keys is not None and _slots(c.keys) > c.offset:
            _cut(c, c.offset)


def normalize(caches: Iterable[Any]) -> None:
    """Drop spare capacity of full-attention caches whose position sits on a step boundary.

    Called before each prefill chunk (a decode step only grows a full cache),
    so every growth starts at the cache's position, as admission projects.
    """
    for c in _leaves(caches):
        if isinstance(c, BatchKVCache):
            position = c._idx
        elif type(c) in _SINGLE:
            position = c.offset
        else:
            continue
        if c.keys is not None and position % _STEP == 0 and _slots(c.keys) > position:
            _cut(c, position)


def cut_prefix(
    cache: list[Any] | None, prompt: list[int], rest: list[int], cached: int
) -> tuple[list[Any] | None, list[int]]:
    """Keep only the first ``cached`` tokens of a fetched prefix (0: none of it).

    ``cache`` covers ``prompt`` but ``rest``; the cut cache must be trimmable
    unless ``cached`` is 0. Returns the cache and the tokens left to prefill.
    """
    have = len(prompt) - len(rest)
    if cache is None or cached >= have:
        return cache, rest
    if cached <= 0:
        return None, prompt
    trim_prompt_cache(cache, have - cached)
    compact(cache)
    return cache, prompt[cached:]


def flatten(caches: Iterable[Any]) -> list[Any]:
    """The layer caches of a model's cache list, a ``CacheList``'s parts in its place."""
    out: list[Any] = []
    for c in caches:
        inner = getattr(c, "caches", None)
        out.extend(flatten(list(inner)) if inner is not None else [c])
    return out
