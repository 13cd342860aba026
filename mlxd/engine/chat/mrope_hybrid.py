"""Qwen3.5's hybrid language model (mlx-vlm's layers) driven over mlx-lm's caches.

mlxd keeps every cache in mlx-lm's classes (the batch generator merges,
filters and extracts them; the prompt cache and the disk tier store them).
mlx-vlm's Qwen3.5 language model is written for mlx-vlm's own caches in two
places, so :func:`forward` runs its layers itself, as mlx-lm's ``qwen3_5``
does (one full-attention mask, one recurrent mask, the layers in turn):

- its model's batch shortcuts (a one-row batch, a left-padded prefill) cut
  the batch into rows with mlx-vlm's cache classes;
- its gated-delta layers call two methods mlx-vlm's ``ArraysCache`` has and
  mlx-lm's lacks: ``update_window`` (keep the trailing convolution window)
  and ``update_recurrent`` (run a state transition). :class:`Recurrent`
  wraps an mlx-lm ``ArraysCache`` for one forward pass with those two
  (mlx-vlm's non-speculative behaviour) and hands every other attribute to
  it.

Upstream, mlx-vlm's caches subclassing mlx-lm's would remove both. Engine
thread only (MLX).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


class Recurrent:
    """One mlx-lm ``ArraysCache`` with mlx-vlm's ``update_window`` and ``update_recurrent``."""

    def __init__(self, inner: ArraysCache):
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def __getitem__(self, index: int) -> Any:
        return self.inner[index]

    def __setitem__(self, index: int, value: Any) -> None:
        self.inner[index] = value

    def update_window(self, index: int, source: mx.array, width: int, *, lengths=None) -> mx.array:
        """Keep the last ``width`` inputs of each row (of its first ``lengths`` when padded)."""
        width = int(width)
        length = source.shape[1] - width
        if lengths is None:
            state = mx.contiguous(source[:, length : length + width])
        else:
            positions = mx.clip(lengths, 0, length)[:, None] + mx.arange(width)
            positions = positions.reshape(*positions.shape, *([1] * (source.ndim - 2)))
            state = mx.take_along_axis(source, positions, axis=1)
        self.inner[index] = state
        return state

    def update_recurrent(self, index: int, length: int, update: Any) -> tuple[mx.array, mx.array]:
        """Run ``update(state, None)`` from the kept state; keep its final state."""
        output, state = update(self.inner[index], None)[:2]
        self.inner[index] = state
        return output, state


def is_hybrid(language_model: Any) -> bool:
    """Whether ``language_model`` is mlx-vlm's Qwen3.5 (linear and full attention layers)."""
    inner = getattr(language_model, "model", None)
    return hasattr(inner, "ssm_idx") and hasattr(inner, "fa_idx")


def forward(
    language_model: Any,
    inputs: mx.array,
    embeds: mx.array | None,
    caches: list[Any],
    position_ids: mx.array,
) -> mx.array:
    """Logits of mlx-vlm's Qwen3.5 language model over mlx-lm ``caches``, at ``position_ids``."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    model = language_model.model
    h = embeds if embeds is not None else model.embed_tokens(inputs)
    wrapped = [Recurrent(c) if type(c) is ArraysCache else c for c in caches]
    fa_mask = create_attention_mask(h, caches[model.fa_idx])
    ssm_mask = create_ssm_mask(h, caches[model.ssm_idx])
    embeddings = None
    for layer in model.layers:
        if not layer.is_linear:
            if not layer.self_attn.rotary_emb.fused_apply:
                embeddings = layer.self_attn.rotary_emb(h, position_ids)
            break
    for layer, cache in zip(model.layers, wrapped, strict=True):
        h = layer(
            h,
            mask=ssm_mask if layer.is_linear else fa_mask,
            cache=cache,
            position_ids=position_ids,
            position_embeddings=embeddings,
        )
    h = model.norm(h)
    if language_model.args.tie_word_embeddings:
        return model.embed_tokens.as_linear(h)
    return language_model.lm_head(h)
