"""A Qwen-VL language model in mlx-lm's batch: each row at its own 3-D positions.

mlx-lm's generator knows one position per token, the cache offset. An mrope
model needs three, and after an image a row's positions run behind its
token count (:mod:`mlxd.engine.chat.mrope_layout`). :class:`MropeVisionLM`
keeps them where mlx-lm already keeps everything a row carries: in its
cache. ``make_cache`` adds one more ``KVCache`` after the language model's,
the *position cache*, whose "keys" are each token's three positions and
whose "values" its image base (int32, 16 bytes a token). Every operation
mlx-lm and mlxd apply to a row's cache (batching with padding, filtering,
extending, extracting a checkpoint, trimming a prompt-cache hit back,
saving to and loading from the disk tier, preemption) applies to it alike,
so a row's positions always match the tokens its cache holds.

A forward pass reads each row's last position from it, with no host sync
unless the chunk holds image tokens: a text token is the previous token's
largest position plus one; an image token is its image's base plus its
place in the grid, the base being the previous largest position plus one
at the image's first token. Engine thread only (MLX).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engine.chat import mrope_hybrid
from mlxd.engine.chat.vision import VisionLM
from mlxd.engine.chat.vision_intake import VIRTUAL_BASE


class MropeVisionLM(VisionLM):
    """:class:`VisionLM` for a language model with multimodal rotary positions."""

    recurrent = True  # Qwen3.5's linear-attention layers, over mlx-lm's ArraysCache

    def __init__(self, vlm: Any):
        super().__init__(vlm)
        self._hybrid = mrope_hybrid.is_hybrid(self.language_model)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [*super().make_cache(), KVCache()]

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if cache is None:  # no cache, no history: positions from 0
            cache = self.make_cache()
        *plain, positions = cache
        embeds = self._embeddings(inputs) if self._by_id else None
        position_ids = self._positions(inputs, positions)
        deep = {}
        if embeds is not None:
            deep = self._deepstack(inputs)
            inputs = mx.where(inputs >= VIRTUAL_BASE, 0, inputs)
        if self._hybrid:
            return mrope_hybrid.forward(self.language_model, inputs, embeds, plain, position_ids)
        out = self.language_model(
            inputs, inputs_embeds=embeds, cache=plain, position_ids=position_ids, **deep
        )
        return out.logits

    def _deepstack(self, inputs: mx.array) -> dict[str, Any]:
        """Qwen3-VL's deepstack inputs for a chunk holding image tokens ({} for others).

        The image tokens' features for the first layers, in the order of
        their positions (row by row), and where they are.
        """
        ids = np.asarray(inputs)
        where: np.ndarray = ids >= VIRTUAL_BASE
        rows = []
        for token in ids[where].tolist():
            images, part, offset = self._by_id[token]
            if images.deepstack is None:
                return {}
            rows.append(images.deepstack[part][:, offset])
        return {
            "visual_pos_masks": mx.array(where),
            "deepstack_visual_embeds": list(mx.stack(rows, axis=1)),
        }

    def _positions(self, inputs: mx.array, cache: Any) -> mx.array:
        """The chunk's position ids (3, B, L); the chunk's positions written to ``cache``."""
        batch, length = inputs.shape
        last, base = _last(cache, batch)
        after = last + 1  # the next text position of each row
        steps = mx.arange(length, dtype=mx.int32)
        host = self._image_layout(inputs) if self._by_id else None
        if host is None:
            pos = after[:, None] + steps[None, :]
            places = mx.broadcast_to(pos[:, :, None], (batch, length, 3))
            bases = pos
        else:
            rel, rel_base, mid_image = host
            anchor = mx.where(mx.array(mid_image), base, after)
            places = anchor[:, None, None] + mx.array(rel)
            bases = anchor[:, None] + mx.array(rel_base)
        cache.update_and_fetch(places[:, None], bases[:, None, :, None])
        return places.transpose(2, 0, 1)

    def _image_layout(self, inputs: mx.array) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Positions relative to each row's anchor, for a chunk holding image tokens.

        Returns (relative places (B, L, 3), relative bases (B, L), whether each
        row's anchor is its image base: the chunk starts inside an image), or
        None when the chunk holds no image token.
        """
        ids = np.asarray(inputs)
        if not (ids >= VIRTUAL_BASE).any():
            return None
        batch, length = ids.shape
        rel = np.zeros((batch, length, 3), dtype=np.int32)
        rel_base = np.zeros((batch, length), dtype=np.int32)
        mid_image = np.zeros(batch, dtype=bool)
        for b in range(batch):
            nxt, base = 0, 0
            for j, token in enumerate(ids[b].tolist()):
                place = self._place(token)
                if place is None:
                    rel[b, j] = nxt
                    rel_base[b, j] = nxt
                    nxt += 1
                    continue
                t, h, w, k, span = place
                if k == 0:
                    base = nxt
                elif j == 0:
                    mid_image[b] = True  # base 0: the stored base is the anchor
                rel[b, j] = (base + t, base + h, base + w)
                rel_base[b, j] = base
                nxt = base + span
        return rel, rel_base, mid_image

    def _place(self, token: int) -> tuple[int, int, int, int, int] | None:
        if token < VIRTUAL_BASE:
            return None
        found = self._by_id.get(token)
        if found is None or found[0].places is None:
            raise RuntimeError("a prompt holds an image whose grid is not registered")
        return found[0].places[token]


def _last(cache: Any, batch: int) -> tuple[mx.array, mx.array]:
    """Each row's largest position so far (-1 for none) and its last image base."""
    empty = mx.full((batch,), -1, dtype=mx.int32)
    if cache.keys is None:
        return empty, empty
    at = cache._idx if hasattr(cache, "_idx") else cache.offset
    if at == 0:
        return empty, empty
    largest = cache.keys[:, 0, at - 1, :].max(axis=-1)
    base = cache.values[:, 0, at - 1, 0]
    offset = cache.offset
    if isinstance(offset, mx.array):  # a batch: a row with no tokens yet starts afresh
        largest = mx.where(offset > 0, largest, -1)
    return largest, base
