"""Qwen-VL image layout as plain numbers (mlxd.engine.chat.mrope_layout): grids, per-image
inputs, each image token's place, and how many tokens an image size becomes."""

from __future__ import annotations

import numpy as np
import pytest

from mlxd.engine.chat.mrope_layout import (
    Grid,
    grids,
    is_mrope,
    smart_resize,
    split_inputs,
    token_places,
)


def test_a_grid_places_its_tokens_frame_by_frame_row_by_row():
    grid = Grid(1, 2, 3)
    assert grid.tokens == 6 and grid.span == 3
    assert [grid.place(k) for k in range(6)] == [
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 1, 2),
    ]  # fmt: skip


def test_inputs_split_per_image_by_their_patch_counts():
    thw = np.array([[1, 4, 4], [1, 8, 4]])
    pixels = np.arange(48 * 5).reshape(48, 5)
    inputs = {"pixel_values": pixels, "image_grid_thw": thw}
    assert grids(inputs, 2) == [Grid(1, 2, 2), Grid(1, 4, 2)]
    parts = split_inputs(inputs)
    assert parts is not None and [p["pixel_values"].shape[0] for p in parts] == [16, 32]
    assert np.array_equal(parts[1]["pixel_values"], pixels[16:])
    assert parts[1]["image_grid_thw"].tolist() == [[1, 8, 4]]
    # Patches that do not add up, or other inputs beside them: not split.
    assert split_inputs({"pixel_values": pixels[:40], "image_grid_thw": thw}) is None
    assert split_inputs({**inputs, "pixel_attention_mask": pixels}) is None


def test_token_places_map_each_virtual_id_and_refuse_a_grid_of_another_size():
    ids = [7, 100, 101, 102, 103, 8]
    places = token_places([Grid(1, 2, 2)], [[1, 2, 3, 4]], ids)
    assert places[103] == (0, 1, 1, 3, 2)
    with pytest.raises(ValueError):
        token_places([Grid(1, 2, 3)], [[1, 2, 3, 4]], ids)


def test_smart_resize_keeps_multiples_of_the_factor_within_the_pixel_bounds():
    assert smart_resize(56, 112, factor=28, min_pixels=56 * 56, max_pixels=112 * 112) == (56, 112)
    h, w = smart_resize(3000, 4000, factor=28, min_pixels=3136, max_pixels=112 * 112)
    assert h % 28 == w % 28 == 0 and h * w <= 112 * 112
    h, w = smart_resize(3, 40, factor=28, min_pixels=56 * 56, max_pixels=112 * 112)
    assert h >= 28 and w >= 28 and h * w >= 56 * 56
    with pytest.raises(ValueError, match="aspect"):
        smart_resize(2, 402, factor=28, min_pixels=3136, max_pixels=12544)


def test_which_configs_are_mrope_families():
    assert is_mrope({"model_type": "qwen3_5_moe"}) and not is_mrope({"model_type": "llava"})
