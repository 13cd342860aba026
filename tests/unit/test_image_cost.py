"""What an image costs a processor, from its header (mlxd.engine.chat.image_cost)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxd.engine.chat import image_cost
from mlxd.engine.images import ImageError, ImagePart


def clip(edge: int = 336, crop: int = 336) -> SimpleNamespace:
    ip = SimpleNamespace(
        size={"shortest_edge": edge},
        crop_size={"height": crop, "width": crop},
        do_resize=True,
        do_center_crop=True,
    )
    return SimpleNamespace(
        image_processor=ip,
        patch_size=14,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
    )


def fixed() -> SimpleNamespace:
    ip = SimpleNamespace(size={"height": 896, "width": 896}, do_resize=True)
    return SimpleNamespace(image_processor=ip, image_seq_length=256)


class Qwen2VLImageProcessor(SimpleNamespace):
    pass


def qwen(low: int = 56 * 56, high: int = 28 * 28 * 1280) -> SimpleNamespace:
    ip = Qwen2VLImageProcessor(
        size={"shortest_edge": low, "longest_edge": high}, patch_size=14, merge_size=2
    )
    return SimpleNamespace(image_processor=ip)


def part(width: int, height: int) -> ImagePart:
    return ImagePart(b"", "PNG", width, height, "messages[0].content[0]")


def test_kinds():
    assert image_cost.kind(clip()) == "clip"
    assert image_cost.kind(fixed()) == "fixed"
    assert image_cost.kind(qwen()) == "qwen"
    assert image_cost.kind(SimpleNamespace(image_processor=SimpleNamespace(size=None))) is None


def test_clip_scales_the_shortest_edge_and_keeps_the_crop_tokens():
    c = image_cost.cost(clip(), 200_000, 1)
    assert (c.width, c.height, c.tokens) == (67_200_000, 336, 576)
    c = image_cost.cost(clip(), 1, 200_000)
    assert (c.width, c.height) == (336, 67_200_000)
    c = image_cost.cost(clip(), 640, 480)
    assert (c.width, c.height, c.tokens) == (448, 336, 576)


def test_fixed_size_costs_its_size_whatever_the_image():
    c = image_cost.cost(fixed(), 600_000, 1)
    assert (c.width, c.height, c.tokens) == (896, 896, 256)


def test_smart_resize_matches_qwen():
    # Values from transformers' own smart_resize (factor 28).
    for size, out in [((1080, 1920), (728, 1316)), ((10, 10), (56, 56)), ((1, 199), (28, 812))]:
        assert image_cost.smart_resize(*size, 28, 56 * 56, 28 * 28 * 1280) == out
    c = image_cost.cost(qwen(), 1920, 1080)
    assert (c.width, c.height, c.tokens) == (1316, 728, (728 // 14) * (1316 // 14) // 4)
    with pytest.raises(ValueError, match="200 times"):
        image_cost.cost(qwen(), 201, 1)


def test_check_applies_image_pixels_to_the_resized_size():
    with pytest.raises(ImageError, match=r"resizes to 67200000x336 .*image_pixels") as err:
        image_cost.check(clip(), [part(200_000, 1)], 16_777_216)
    assert err.value.param == "messages[0].content[0]"
    assert image_cost.check(clip(), [part(640, 480), part(28, 28)], 16_777_216) == 2 * 576
    with pytest.raises(ImageError, match="200 times"):
        image_cost.check(qwen(), [part(1, 1000)], 16_777_216)


def test_refusal_counts_image_tokens_against_the_context():
    room = SimpleNamespace(bytes=1 << 40, over=lambda n, what: what)
    big = qwen(high=28 * 28 * 100_000)
    failed = image_cost.refusal(
        big,
        [part(8000, 8000)],
        max_pixels=1 << 40,
        context_length=4096,
        layout=None,
        room=room,
        decode_allowance=16,
        prefill_step_size=512,
    )
    assert failed is not None and failed.code == "context_length_exceeded"
    assert "images alone take" in failed.message
