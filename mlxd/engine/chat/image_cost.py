"""What an image costs once the model's processor has it, from its header alone (no pixels).

The header's width and height are not what an image costs: a processor
resizes first. A CLIP-style processor scales the *shortest* edge to its size
(a 200000x1 image becomes 5,600,000x28 before its crop), a Gemma-style one
resizes to a fixed size, a Qwen-VL-style one (``smart_resize``) to a multiple
of its patch within a pixel range, and makes tokens in proportion. So each
image's size after the resize and its token count are computed here, from the
processor's settings and the header, before anything is decoded; intake
applies ``[limits] image_pixels`` to that size and counts the tokens against
the context and the KV budget (:mod:`mlxd.engine.chat.intake`).

One function per processor kind, in :data:`SIZERS`; :func:`kind` tells which
kind a processor is. A new family plugs in by adding its function there (and
a test in tests/unit/test_image_cost.py). An unknown kind costs only what its
header says (the older check), so nothing is refused that was taken before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxd.engine.chat.mrope_layout import smart_resize as qwen_resize
from mlxd.engine.images import ImageError, ImagePart
from mlxd.engine.messages import Failed
from mlxd.engine.policy import admission

# Qwen-VL's smart_resize refuses a longer edge more than this many times the shorter.
QWEN_MAX_RATIO = 200


@dataclass(frozen=True)
class ImageCost:
    """One image as the processor holds it: the largest array it builds, and its tokens."""

    width: int
    height: int
    # Image tokens the processor writes for it; None when the kind does not say.
    tokens: int | None

    @property
    def pixels(self) -> int:
        return self.width * self.height


def _get(size: Any, key: str) -> Any:
    """``size[key]`` for a dict or a transformers ``SizeDict`` (None when absent)."""
    if size is None:
        return None
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def _image_processor(processor: Any) -> Any:
    return getattr(processor, "image_processor", None) or processor


def shortest_edge_resize(width: int, height: int, edge: int) -> tuple[int, int]:
    """transformers' ``get_resize_output_image_size(default_to_square=False)``."""
    short, long = min(width, height), max(width, height)
    new_long = int(edge * long / short)
    return (edge, new_long) if width <= height else (new_long, edge)


def clip_cost(processor: Any, width: int, height: int) -> ImageCost:
    """CLIP-style (llava): shortest edge to ``size.shortest_edge``, then a center crop."""
    ip = _image_processor(processor)
    edge = _get(ip.size, "shortest_edge")
    resized = (width, height)
    if getattr(ip, "do_resize", True) and edge:
        resized = shortest_edge_resize(width, height, int(edge))
    crop = getattr(ip, "crop_size", None)
    final = resized
    if getattr(ip, "do_center_crop", False) and _get(crop, "height") and _get(crop, "width"):
        final = (int(_get(crop, "width")), int(_get(crop, "height")))
    tokens = None
    patch = getattr(processor, "patch_size", None)
    if patch:
        tokens = (final[0] // patch) * (final[1] // patch)
        tokens += int(getattr(processor, "num_additional_image_tokens", 0) or 0)
        if getattr(processor, "vision_feature_select_strategy", None) == "default":
            tokens -= 1
    return ImageCost(max(resized[0], final[0]), max(resized[1], final[1]), tokens)


def fixed_cost(processor: Any, width: int, height: int) -> ImageCost:
    """Gemma/SigLIP-style: resized to ``size.height`` x ``size.width`` whatever it was."""
    ip = _image_processor(processor)
    if not getattr(ip, "do_resize", True):
        return ImageCost(width, height, None)
    seq = getattr(processor, "image_seq_length", None) or getattr(
        processor, "num_image_tokens", None
    )
    return ImageCost(int(_get(ip.size, "width")), int(_get(ip.size, "height")), seq and int(seq))


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's resize (:func:`mlxd.engine.chat.mrope_layout.smart_resize`).

    Raises:
        ValueError: the longer edge is more than 200 times the shorter, which
            the processor itself refuses.
    """
    if max(height, width) / min(height, width) > QWEN_MAX_RATIO:
        raise ValueError(
            f"the model's processor takes images at most {QWEN_MAX_RATIO} times as wide as "
            f"high (or high as wide); this one is {width}x{height}"
        )
    return qwen_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def qwen_cost(processor: Any, width: int, height: int) -> ImageCost:
    """Qwen-VL-style: ``smart_resize`` to patch x merge multiples, a token per merged patch."""
    ip = _image_processor(processor)
    patch = int(getattr(ip, "patch_size", 14) or 14)
    merge = int(getattr(ip, "merge_size", 2) or 2)
    size = getattr(ip, "size", None)
    low = getattr(ip, "min_pixels", None) or _get(size, "shortest_edge") or 56 * 56
    high = getattr(ip, "max_pixels", None) or _get(size, "longest_edge") or 28 * 28 * 1280
    h, w = smart_resize(height, width, patch * merge, int(low), int(high))
    return ImageCost(w, h, (h // patch) * (w // patch) // (merge * merge))


Sizer = Callable[[Any, int, int], ImageCost]

SIZERS: dict[str, Sizer] = {"clip": clip_cost, "fixed": fixed_cost, "qwen": qwen_cost}


def kind(processor: Any) -> str | None:
    """Which of :data:`SIZERS` sizes this processor's images, or None when none does."""
    ip = _image_processor(processor)
    name = type(ip).__name__.lower()
    size = getattr(ip, "size", None)
    if "qwen" in name or getattr(ip, "merge_size", None):
        return "qwen"
    if _get(size, "shortest_edge") and not _get(size, "longest_edge"):
        return "clip"
    if _get(size, "height") and _get(size, "width"):
        return "fixed"
    return None


def cost(processor: Any, width: int, height: int) -> ImageCost:
    """What one ``width`` x ``height`` image costs the model's processor.

    Raises:
        ValueError: the processor would refuse the image (Qwen's aspect limit).
    """
    sizer = SIZERS.get(kind(processor) or "")
    if sizer is None:
        return ImageCost(width, height, None)
    return sizer(processor, width, height)


def check(processor: Any, images: Sequence[ImagePart], max_pixels: int) -> int:
    """Each image's size after the resize against ``max_pixels``; the image tokens they make.

    Returns the images' tokens as far as the processor's kind tells them
    (a lower bound; 0 for a kind that does not say).

    Raises:
        ImageError: naming the image, when the resized image has more pixels
            than ``max_pixels`` or the processor would refuse it.
    """
    tokens = 0
    for part in images:
        try:
            c = cost(processor, part.width, part.height)
        except ValueError as exc:
            raise ImageError(str(exc), part.where) from exc
        if c.pixels > max_pixels:
            raise ImageError(
                f"the image is {part.width}x{part.height} pixels, which the model's processor "
                f"resizes to {c.width}x{c.height} ({c.pixels:,} pixels); the most one image may "
                f"have after that resize is {max_pixels:,} ([limits] image_pixels)",
                part.where,
            )
        tokens += c.tokens or 0
    return tokens


def refusal(
    processor: Any,
    images: Sequence[ImagePart],
    *,
    max_pixels: int,
    context_length: int,
    layout: Any,
    room: Any,
    decode_allowance: int,
    prefill_step_size: int,
) -> Failed | None:
    """The 400 for images that cost too much, before any is decoded; None when they fit.

    Their resized pixels against ``max_pixels``, their tokens alone against
    the context and (with one token to generate) the KV budget ``room``.
    """
    try:
        tokens = check(processor, images, max_pixels)
    except ImageError as exc:
        return Failed("invalid_image", f"{exc.param}: {exc}", 400, param=exc.param)
    if tokens >= context_length:
        return Failed(
            "context_length_exceeded",
            f"This model's maximum context length is {context_length} tokens. However, the "
            f"prompt's images alone take {tokens} tokens, which leaves no room to generate.",
            400,
            param="messages",
        )
    extent = admission.row_extent(tokens, 1, decode_allowance)
    alone = admission.never_fits(layout, extent, room.bytes, prefill_step_size)
    if alone is not None:
        return Failed(
            "context_over_budget",
            room.over(alone, f"This request's images ({tokens} prompt tokens)"),
            400,
        )
    return None
