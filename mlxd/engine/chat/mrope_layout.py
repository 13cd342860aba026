"""Multimodal rotary positions (mrope) of the Qwen-VL families, as plain numbers (no MLX).

Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 give every token a 3-D position
(time, height, width). A text token's three are equal; an image's tokens
take their place in the image's grid (after the 2x2 spatial merge) added
to the image's *base*, the position the next text token would have had.
The text after an image continues at ``base + max(t, h, w)``: the row's
positions run behind its token count (mlx-vlm's ``get_rope_index`` calls
the difference the rope delta).

This module holds the intake side: which models use it, each image's grid
(``image_grid_thw``), the per-image split of the processor's inputs (so the
vision tower can run one image at a time), the grid place of every image
token, and how many tokens an image of a given size becomes. The model side
(:mod:`mlxd.engine.chat.mrope`) turns them into position ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# The families whose language model takes 3-D positions and that mlxd serves with images.
MROPE_FAMILIES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}
)


def is_mrope(config: dict[str, Any]) -> bool:
    """Whether a model's ``config.json`` names one of :data:`MROPE_FAMILIES`."""
    return str(config.get("model_type", "")) in MROPE_FAMILIES


@dataclass(frozen=True)
class Grid:
    """One image's token grid: ``t`` frames of ``h`` x ``w`` tokens (after the merge)."""

    t: int
    h: int
    w: int

    @property
    def tokens(self) -> int:
        return self.t * self.h * self.w

    @property
    def span(self) -> int:
        """How far the positions move past the image: ``max(t, h, w)``."""
        return max(self.t, self.h, self.w)

    def place(self, k: int) -> tuple[int, int, int]:
        """The (time, height, width) offset of the image's ``k``-th token."""
        return k // (self.h * self.w), (k // self.w) % self.h, k % self.w


def grids(inputs: dict[str, np.ndarray], merge: int) -> list[Grid] | None:
    """Each image's token grid from the processor's ``image_grid_thw``, or None."""
    thw = inputs.get("image_grid_thw")
    if thw is None:
        return None
    rows = np.asarray(thw).reshape(-1, 3).tolist()
    return [Grid(int(t), int(h) // merge, int(w) // merge) for t, h, w in rows]


def split_inputs(inputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]] | None:
    """The processor's inputs cut into one dict per image, or None when they cannot be.

    Qwen-VL processors flatten every image's patches into one ``pixel_values``
    array (``t * h * w`` patch rows per image, before the merge) beside one
    ``image_grid_thw`` row per image.
    """
    pixels, thw = inputs.get("pixel_values"), inputs.get("image_grid_thw")
    if pixels is None or thw is None or set(inputs) != {"pixel_values", "image_grid_thw"}:
        return None
    rows = np.asarray(thw).reshape(-1, 3)
    counts = [int(t * h * w) for t, h, w in rows.tolist()]
    if sum(counts) != pixels.shape[0]:
        return None
    out, at = [], 0
    for i, n in enumerate(counts):
        out.append({"pixel_values": pixels[at : at + n], "image_grid_thw": rows[i : i + 1]})
        at += n
    return out


# A virtual id's place: (time, height, width) in its image's grid, its index there, the span.
Place = tuple[int, int, int, int, int]


def token_places(
    image_grids: list[Grid], runs: list[list[int]], ids: list[int]
) -> dict[int, Place]:
    """Every image token's virtual id mapped to its place in its image's grid.

    ``runs`` are the prompt indices of each image's tokens, in prompt order
    (one run per image); ``ids`` the prompt with its virtual ids.
    """
    out: dict[int, Place] = {}
    for grid, run in zip(image_grids, runs, strict=True):
        if len(run) != grid.tokens:
            raise ValueError(f"an image of {grid.tokens} grid tokens has {len(run)} in the prompt")
        for k, pos in enumerate(run):
            out[ids[pos]] = (*grid.place(k), k, grid.span)
    return out


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size a Qwen-VL processor resizes an image to (HF's ``smart_resize``).

    Raises:
        ValueError: the aspect ratio passes 200, which the processors refuse.
    """
    if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}x{height} has an aspect ratio past 200")
    h_bar = round(height / factor) * factor  # 0 for an edge under factor / 2: then min_pixels
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_tokens(processor: Any, width: int, height: int) -> int | None:
    """How many prompt tokens an image of ``width`` x ``height`` becomes, or None when unknown.

    Reads a Qwen-VL image processor's ``patch_size``, ``merge_size``,
    ``min_pixels`` and ``max_pixels``; None for other processors.
    """
    image = getattr(processor, "image_processor", None)
    names = ("patch_size", "merge_size", "min_pixels", "max_pixels")
    values = [getattr(image, n, None) for n in names]
    numbers = [v for v in values if isinstance(v, int)]
    if len(numbers) != len(names):
        return None
    patch, merge, low, high = numbers
    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=low, max_pixels=high)
    return (h // patch // merge) * (w // patch // merge)
