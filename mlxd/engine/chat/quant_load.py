"""Applying ``[batch] kv_bits`` to a loaded model: its cache layout measured quantized.

The bytes per token admission projects with come from a fresh quantized
cache (:mod:`mlxd.engine.chat.quant_cache`), as do the cache classes a disk
entry must match and whether every layer rewinds. Engine thread only (MLX).
"""

from __future__ import annotations

from dataclasses import replace

from mlxd.engine.chat.kv_caches import flatten
from mlxd.engine.chat.loading import LoadedModel, ModelLoadError, cache_facts, measure_layout
from mlxd.engine.chat.quant_cache import QuantKVCache, fresh_cache, register


def with_quantized_kv(loaded: LoadedModel, bits: int, group_size: int) -> LoadedModel:
    """``loaded`` with its KV cache quantized: the layout (bytes per token) measured anew.

    Raises:
        ModelLoadError: ``group_size`` does not divide a quantized layer's head size.
    """
    register()
    kv_quant = (bits, group_size)
    try:
        layout, _ = measure_layout(loaded.model, fresh_cache(loaded.model, kv_quant))
    except ValueError as exc:
        raise ModelLoadError(
            f"[batch] kv_bits = {bits} with kv_group_size = {group_size} does not fit "
            f"this model's attention heads: {exc}"
        ) from exc
    fresh = fresh_cache(loaded.model, kv_quant)
    classes, rewindable = cache_facts(fresh)
    if not any(isinstance(c, QuantKVCache) for c in flatten(fresh)):
        return loaded  # no full-attention layer: nothing to quantize
    return replace(
        loaded,
        layout=layout,
        cache_classes=classes,
        rewindable=rewindable,
        kv_quant=kv_quant,
        kv_plain_bytes_per_token=loaded.layout.bytes_per_token,
    )
