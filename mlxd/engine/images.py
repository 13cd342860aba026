"""Images a request carries: read from base64, checked against the limits, no MLX.

The HTTP side turns every API's image part (OpenAI ``image_url`` data URLs,
Responses ``input_image``, Anthropic ``image`` blocks) into an
:class:`ImagePart` with :func:`from_base64`: the bytes are decoded and the
image's header is read (format and dimensions) WITHOUT decoding its pixels,
so a decompression bomb is refused before it costs memory. The pixels are
decoded later, on the engine's intake thread (:func:`decode`), where an image
that fails to decode is refused with a 400 naming its part too.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

# Formats accepted, as Pillow names them, and the media types that name them.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MEDIA_TYPES = frozenset(FORMATS.values())

# A placeholder part in a ChatPrompt message's content list: {"type": "image", "image": i},
# ``i`` indexing ChatPrompt.images.
IMAGE_PART = "image"


class ImageError(ValueError):
    """An image part that cannot be taken; ``param`` names the part."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    max_images: int
    # The longest edge may be at most this many times the shortest ([limits] image_aspect_ratio).
    max_aspect: float = 200.0


@dataclass(frozen=True)
class ImagePart:
    """One image of a request: its encoded bytes and what its header says.

    ``where`` is the request parameter it came from (``messages[0].content[1]``),
    for the error that names it.
    """

    data: bytes = field(repr=False)
    format: str
    width: int
    height: int
    where: str
    # A remote image not fetched yet ([server] fetch_images): the HTTP side fetches it
    # (mlxd.api.image_fetch) before the request is queued; ``data`` is empty until then.
    url: str | None = None


_WHITESPACE = re.compile(r"\s")

_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.I)


def from_data_url(url: str, where: str, limits: ImageLimits, *, remote: bool = False) -> ImagePart:
    """An OpenAI ``image_url.url`` (``data:image/png;base64,...``) as an ImagePart.

    With ``remote``, an ``http(s)`` URL becomes a part to fetch (``url`` set,
    no data yet).

    Raises:
        ImageError: not a base64 data URL (nor, with ``remote``, an http(s)
            URL), or see :func:`from_base64`.
    """
    if not isinstance(url, str):
        raise ImageError("an image URL must be a string", where)
    match = _DATA_URL.match(url[:200])
    if match is None:
        if url.lower().startswith(("http://", "https://")):
            if remote:
                if len(url) > 2048:
                    raise ImageError("an image URL may have at most 2048 characters", where)
                return ImagePart(b"", "", 0, 0, where, url=url)
            raise ImageError(
                "mlxd does not fetch remote images ([server] fetch_images is off): send the "
                "image inline as a base64 data URL (data:image/png;base64,...)",
                where,
            )
        raise ImageError(
            "an image URL must be a base64 data URL (data:image/png;base64,...)", where
        )
    media = (match.group("type") or "").lower()
    return from_base64(url[match.end() :], media or None, where, limits)


def from_base64(payload: str, media_type: str | None, where: str, limits: ImageLimits) -> ImagePart:
    """Base64 image bytes, checked: size, format, dimensions (from the header only).

    ``media_type`` (when given) must be one mlxd takes; the bytes decide the
    format, and a mismatch with it is refused.

    Raises:
        ImageError: the payload is not base64, is larger than
            ``limits.max_bytes``, is not a PNG, JPEG, WebP or GIF image, or has
            more than ``limits.max_pixels`` pixels.
    """
    if media_type is not None and media_type not in MEDIA_TYPES:
        raise ImageError(
            f"image type {media_type!r} is not supported; send one of "
            f"{', '.join(sorted(MEDIA_TYPES))}",
            where,
        )
    if not isinstance(payload, str):
        raise ImageError("image data must be a base64 string", where)
    # Decoded size is 3/4 of the text: refuse a too-large image before decoding it.
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise ImageError(_too_large(len(payload) * 3 // 4, limits), where)
    if _WHITESPACE.search(payload):
        # MIME-wrapped base64 (76-column lines, CRLF): the line breaks are not data.
        payload = "".join(payload.split())
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"image data is not valid base64: {exc}", where) from exc
    return from_bytes(data, media_type, where, limits)


def from_bytes(data: bytes, media_type: str | None, where: str, limits: ImageLimits) -> ImagePart:
    """Image bytes, checked as :func:`from_base64` checks them (after base64)."""
    if len(data) > limits.max_bytes:
        raise ImageError(_too_large(len(data), limits), where)
    if not data:
        raise ImageError("image data is empty", where)
    fmt, width, height = _header(data, where)
    if media_type is not None and FORMATS[fmt] != media_type:
        raise ImageError(
            f"the image is a {fmt} image, but its media type says {media_type!r}", where
        )
    if width * height > limits.max_pixels:
        raise ImageError(
            f"the image is {width}x{height} pixels ({width * height:,}); the most one image "
            f"may have is {limits.max_pixels:,} ([limits] image_pixels)",
            where,
        )
    if max(width, height) > limits.max_aspect * min(width, height):
        raise ImageError(
            f"the image is {width}x{height} pixels; its longer edge may be at most "
            f"{limits.max_aspect:g} times its shorter ([limits] image_aspect_ratio): a "
            "model's processor resizes by the shorter edge, so a long thin image costs "
            "far more than its pixels",
            where,
        )
    return ImagePart(data, fmt, width, height, where)


def _too_large(size: int, limits: ImageLimits) -> str:
    return (
        f"the image is {size:,} bytes; the most one image may have is "
        f"{limits.max_bytes:,} bytes ([limits] image_bytes)"
    )


def _pillow(where: str) -> Any:
    """Pillow, which images need (mlx-vlm pulls it in with the embeddings extra)."""
    try:
        import PIL.Image
    except ImportError as exc:
        raise ImageError(
            "this mlxd has no image support (Pillow is not installed); images need a "
            "vision-language model and mlx-vlm: pip install 'mlxd[embeddings]'",
            where,
        ) from exc
    return PIL.Image


def _header(data: bytes, where: str) -> tuple[str, int, int]:
    """The format and size Pillow reads from the header, without decoding pixels."""
    _pillow(where)
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # The pixel limit is ours (checked by the caller): Pillow's own check
            # warns or raises at open with its default; it runs again at decode.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                fmt = image.format or ""
                width, height = image.size
    except UnidentifiedImageError as exc:
        raise ImageError(
            f"the data is {_what(data)}; send a PNG, JPEG, WebP or GIF image", where
        ) from exc
    except (Image.DecompressionBombError, OSError, ValueError) as exc:
        raise ImageError(f"the image cannot be read: {exc}", where) from exc
    if fmt not in FORMATS:
        raise ImageError(
            f"{fmt or 'this'} images are not supported; send a PNG, JPEG, WebP or GIF image",
            where,
        )
    if width <= 0 or height <= 0:
        raise ImageError(f"the image has no pixels ({width}x{height})", where)
    return fmt, width, height


def _what(data: bytes) -> str:
    """What unreadable image data looks like, for the error (never the Python object)."""
    head = data[:512].lstrip().lower()
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head):
        return "an SVG image (vector images are not taken)"
    return "not an image mlxd can read"


def decode(part: ImagePart):  # -> PIL.Image.Image
    """The image's pixels as an RGB Pillow image (a GIF's first frame).

    Runs on the intake thread, after the HTTP side checked the header's size
    against the limits; an image whose size is not what that header said stops.

    Raises:
        ImageError: the pixels cannot be decoded (a truncated or corrupt file).
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(part.data))
            if image.size != (part.width, part.height):
                raise ImageError("the image has more pixels than its header said", part.where)
            image.seek(0)
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ... on bad data
        raise ImageError(f"the image cannot be decoded: {exc}", part.where) from exc


def count_check(count: int, limits: ImageLimits, where: str) -> None:
    """Refuse a request with more images than ``limits.max_images``."""
    if count > limits.max_images:
        raise ImageError(
            f"this request carries {count} images; the most one request may carry is "
            f"{limits.max_images} ([limits] max_images)",
            where,
        )
