"""A vision-language model served as a text model whose prompts may hold images.

mlx-vlm loads the model (vision tower, projector, language model) and its
processor. mlxd drives the LANGUAGE model with mlx-lm's own machinery (the
batch generator, the serial lane, the prompt cache), through
:class:`VisionLM`: an mlx-lm-shaped model whose token ids may include
*virtual ids* (``>= VIRTUAL_BASE``), one per image token, derived from a
hash of the image's pixels (:mod:`mlxd.engine.chat.vision_intake`). The
prompt cache keys prompts by token ids, so the same image yields the same
ids (a second turn reuses its prefill) and a different image never does.

Before a row with images prefills, its :class:`ImageSet` is *registered*:
the first image still to prefill goes through the vision tower then, on the
engine thread, between two steps; each further image when the prefill chunk
that holds its first token runs (so one step waits for the images of its own
chunk only), and each image's embeddings are kept by virtual id while the
row prefills. A prompt-cache hit that covers every image token runs no
tower at all. A forward pass whose tokens
hold virtual ids gets the text embeddings for the ordinary ids and the
image embeddings for the virtual ones, and runs the language model on
``inputs_embeds``. A set is released when its row's prefill is over.

Everything here runs on the engine thread.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engine.chat.vision_intake import VIRTUAL_BASE, ImageSet

logger = logging.getLogger(__name__)


def _mlx_lm_cache(cache: Any, recurrent: bool = False) -> Any:
    """mlx-vlm's cache object as the mlx-lm cache with the same behaviour (batchable).

    ``recurrent``: the model drives mlx-vlm's recurrent layers over mlx-lm's
    ``ArraysCache`` (:mod:`mlxd.engine.chat.mrope`).
    """
    from mlx_lm.models import cache as lm_cache

    name = type(cache).__name__
    if name == "KVCache":
        return lm_cache.KVCache()
    if name == "RotatingKVCache":
        return lm_cache.RotatingKVCache(max_size=cache.max_size, keep=getattr(cache, "keep", 0))
    if name == "ArraysCache" and recurrent:
        return lm_cache.ArraysCache(len(cache.cache))
    raise ValueError(
        f"mlxd's vision path serves attention caches (KVCache, RotatingKVCache), and "
        f"recurrent ones for Qwen3.5; this model's language model uses {name}"
    )


class VisionLM:
    """The language model of a mlx-vlm model, shaped like an mlx-lm model.

    ``model(ids, cache=...)`` returns logits; virtual ids in ``ids`` are
    replaced by the registered images' embeddings.
    """

    # Whether mlx-vlm's recurrent layers may run over mlx-lm's ArraysCache (mrope.py).
    recurrent = False

    def __init__(self, vlm: Any):
        self.vlm = vlm
        self.language_model = vlm.language_model
        self._embed = vlm.language_model.model.embed_tokens
        # virtual id -> (its set, the part of the set, row in that part's features)
        self._by_id: dict[int, tuple[ImageSet, int, int]] = {}
        # set key -> (the set, how many rows hold it)
        self._held: dict[str, tuple[ImageSet, int]] = {}
        # Seconds the vision tower took, per registration (the dashboard's and benchmark's).
        self.last_encode_s = 0.0

    @property
    def layers(self) -> list[Any]:
        return self.language_model.layers

    def make_cache(self) -> list[Any]:
        make = getattr(self.language_model, "make_cache", None)
        if make is None:
            from mlx_lm.models.cache import KVCache

            return [KVCache() for _ in self.layers]
        return [_mlx_lm_cache(c, self.recurrent) for c in make()]

    @property
    def holding(self) -> int:
        """Image sets registered now (rows with images still prefilling)."""
        return len(self._held)

    def register(self, images: ImageSet, needed: list[int]) -> float:
        """Keep ``images`` for the prefill; run the tower for the first part ``needed`` holds.

        ``needed`` are the virtual ids still to prefill. The first image among
        them goes through the tower now, between two steps (a failure there
        fails this row alone); each further image when the prefill chunk that
        holds its first token runs, so one step never waits for more than the
        images of its chunk. Returns the seconds the tower ran now.
        """
        held = self._held.get(images.key)
        if held is not None:
            self._held[images.key] = (held[0], held[1] + 1)
            return 0.0
        parts = images.parts()
        if images.features is None:
            images.features = [None] * len(parts)
        for part, (first, n) in enumerate(parts):
            for offset in range(n):
                self._by_id[images.ids[first + offset]] = (images, part, offset)
        self._held[images.key] = (images, 1)
        first_needed = next(p for p in (self._by_id.get(v) for v in needed) if p is not None)
        started = time.perf_counter()
        try:
            self._features(images, first_needed[1])
        except BaseException:
            self.release(images)
            raise
        return time.perf_counter() - started

    def release(self, images: ImageSet) -> float:
        """Drop one hold of ``images``; returns tower seconds spent on them while prefilling."""
        held = self._held.get(images.key)
        if held is None:
            return 0.0
        seconds, images.seconds = images.seconds, 0.0
        if held[1] > 1:
            self._held[images.key] = (held[0], held[1] - 1)
            return seconds
        del self._held[images.key]
        for vid in held[0].ids:
            self._by_id.pop(vid, None)
        return seconds

    def _features(self, images: ImageSet, part: int) -> mx.array:
        """Part ``part``'s embeddings, running the tower for it when not done yet."""
        assert images.features is not None
        found = images.features[part]
        if found is None:
            started = time.perf_counter()
            found = images.features[part] = self._encode(images, part)
            self.last_encode_s = time.perf_counter() - started
        return found

    def _encode(self, images: ImageSet, part: int) -> mx.array:
        _, n = images.parts()[part]
        ids = mx.array([[images.placeholder] * n])
        inputs = images.inputs
        if images.spans and images.per_image is not None:  # one image: its own inputs
            inputs = images.per_image[part]
        kwargs = {k: mx.array(v) for k, v in inputs.items()}
        pixels = kwargs.pop("pixel_values", None)
        if "mask" in inspect.signature(self.vlm.get_input_embeddings).parameters:
            kwargs.setdefault("mask", mx.ones(ids.shape, dtype=mx.int32))  # gemma3 wants one
        out = self.vlm.get_input_embeddings(ids, pixels, **kwargs)
        features = out.inputs_embeds[0]
        if features.shape[0] != n:
            raise ValueError(f"the vision tower gave {features.shape[0]} embeddings for {n} tokens")
        deep = getattr(out, "deepstack_visual_embeds", None)
        if deep is not None:  # Qwen3-VL: features for its first layers too (mrope.py)
            if images.deepstack is None:
                images.deepstack = [None] * len(images.parts())
            images.deepstack[part] = mx.stack(list(deep))
            mx.eval(images.deepstack[part])
        mx.eval(features)
        return features

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self._by_id and kwargs.get("input_embeddings") is None:
            embeds = self._embeddings(inputs)
            if embeds is not None:
                out = self.language_model(
                    mx.where(inputs >= VIRTUAL_BASE, 0, inputs), inputs_embeds=embeds, cache=cache
                )
                return out.logits
        out = self.language_model(inputs, cache=cache)
        return out.logits

    def _embeddings(self, inputs: mx.array) -> mx.array | None:
        """Text embeddings with the virtual ids' image embeddings in place, or None."""
        ids = np.asarray(inputs)
        where = np.flatnonzero(ids.reshape(-1) >= VIRTUAL_BASE)
        if where.size == 0:
            return None
        flat = ids.reshape(-1)
        text = self._embed(mx.array(np.where(ids >= VIRTUAL_BASE, 0, ids)))
        shape = text.shape
        rows = []
        for pos in where.tolist():
            found = self._by_id.get(int(flat[pos]))
            if found is None:  # never expected: a virtual id without its image
                raise RuntimeError("a prompt holds an image whose embeddings are not registered")
            images, part, offset = found
            if images.features is not None and images.features[part] is None:
                started = time.perf_counter()  # an image this chunk reaches first
                self._features(images, part)
                images.seconds += time.perf_counter() - started
            rows.append(self._features(images, part)[offset])
        table = mx.stack(rows).astype(text.dtype)
        merged = text.reshape(-1, shape[-1])
        merged[mx.array(where)] = table
        return merged.reshape(shape)


def hold(model: Any, row: Any, rest: list[int]) -> None:
    """Register ``row``'s images when the part of its prompt still to prefill holds any.

    A prompt-cache hit that covers every image token needs no vision tower at all.
    """
    if row.images is None or row.images_held or not isinstance(model, VisionLM):
        return
    needed = [t for t in rest if t >= VIRTUAL_BASE]
    if not needed:
        return
    row.vision_seconds += model.register(row.images, needed)
    row.images_held = True


def let_go(model: Any, row: Any) -> None:
    """Release ``row``'s images (its prefill is over, or it left)."""
    if row.images_held and isinstance(model, VisionLM):
        row.vision_seconds += model.release(row.images)
    row.images_held = False


def guard_tokens(processor: Any, placeholder: int) -> Any:
    """``processor`` seeing each virtual id as the image token (penalties index logits by id)."""

    def processor_without_virtual(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(mx.where(tokens >= VIRTUAL_BASE, placeholder, tokens), logits)

    return processor_without_virtual
