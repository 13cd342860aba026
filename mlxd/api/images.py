"""Image parts of a request, gathered in prompt order for a ChatPrompt (every API).

Each API's message parser hands its image parts here (an OpenAI data URL,
a Responses ``input_image``, an Anthropic base64 ``source``); the collector
checks each against ``[limits]`` (bytes, pixels from the header, images per
request) and returns the placeholder part the message's content list holds.
A violation is a 400 naming the part, in the error shape of the API it
came in on (the router's envelope renders the OpenAIError).
"""

from __future__ import annotations

from typing import Any

from mlxd.api.params import bad
from mlxd.config import Settings
from mlxd.engine import (
    IMAGE_PART,
    ImageError,
    ImageLimits,
    ImagePart,
    check_image_count,
    image_from_base64,
    image_from_data_url,
)


class Images:
    """The images of one request, in order."""

    def __init__(self, settings: Settings):
        limits = settings.limits
        self.limits = ImageLimits(
            max_bytes=int(limits.image_bytes),
            max_pixels=limits.image_pixels,
            max_images=limits.max_images,
            max_aspect=limits.image_aspect_ratio,
        )
        self.remote = settings.server.fetch_images
        self.parts: list[ImagePart] = []

    def data_url(self, url: Any, where: str) -> dict[str, Any]:
        """An OpenAI ``image_url`` (a base64 data URL) as a content part."""
        self._room(where)
        try:
            return self._add(image_from_data_url(url, where, self.limits, remote=self.remote))
        except ImageError as exc:
            raise bad(exc.param, f"{exc.param}: {exc}", code="invalid_image") from exc

    def base64(self, data: Any, media_type: Any, where: str) -> dict[str, Any]:
        """An Anthropic base64 ``source`` as a content part."""
        self._room(where)
        if media_type is not None and not isinstance(media_type, str):
            raise bad(where, f"{where}: media_type must be a string", code="invalid_image")
        try:
            return self._add(image_from_base64(data, media_type, where, self.limits))
        except ImageError as exc:
            raise bad(exc.param, f"{exc.param}: {exc}", code="invalid_image") from exc

    def _room(self, where: str) -> None:
        try:
            check_image_count(len(self.parts) + 1, self.limits, where)
        except ImageError as exc:
            raise bad(exc.param, f"{exc.param}: {exc}", code="too_many_images") from exc

    def _add(self, part: ImagePart) -> dict[str, Any]:
        self.parts.append(part)
        return {"type": IMAGE_PART, "image": len(self.parts) - 1}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content: one string when it is text only (as before), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts
