"""A chat prompt with images as token ids, on the intake thread (no MLX).

The images are decoded (:func:`mlxd.engine.images.decode`), the messages
rendered with the chat template (image parts as the template's image
markers), and the model's processor expands each marker into its image
tokens and turns the pixels into the vision tower's inputs (numpy).

Each image token then gets a *virtual id* (``>= VIRTUAL_BASE``) derived
from a hash of the image's pixel values and the token's place in the
image: the prompt cache keys prompts by token ids, so a second turn about
the same image reuses its prefill and a different image never matches.
When the processor's image tokens cannot be told apart per image (one run
per image), all images of the request share one hash: still never a false
match, only fewer hits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxd.engine.chat import mrope_layout
from mlxd.engine.chat.mrope_layout import Place
from mlxd.engine.checks import IntakeError
from mlxd.engine.images import IMAGE_PART, ImageError, decode
from mlxd.engine.messages import ChatPrompt

# Virtual ids live in [VIRTUAL_BASE, 2 * VIRTUAL_BASE): above every vocabulary,
# inside int32 (MLX's token arrays).
VIRTUAL_BASE = 1 << 30


@dataclass(eq=False)
class ImageSet:
    """A request's images as the vision tower takes them, and their virtual ids."""

    key: str
    ids: tuple[int, ...]
    placeholder: int
    inputs: dict[str, np.ndarray] = field(repr=False)
    count: int = 1
    # Image tokens per image, when each image can go through the vision tower alone
    # (one run of tokens per image, pixels the only input); empty: all images at once.
    spans: tuple[int, ...] = ()
    # The vision tower's output per part (an image, or all of them), one row per id:
    # mx.arrays, set on the engine thread (mlxd.engine.chat.vision).
    features: Any = field(default=None, repr=False)
    # Tower seconds spent while prefilling, not yet counted to a row.
    seconds: float = 0.0
    # Each image's own inputs, when the tower can take one image at a time (with spans).
    per_image: list[dict[str, np.ndarray]] | None = field(default=None, repr=False)
    # Multimodal rotary positions: each virtual id's place in its image's grid
    # (mlxd.engine.chat.mrope_layout); None for plain positions.
    places: dict[int, Place] | None = field(default=None, repr=False)
    # Qwen3-VL's deepstack: per part, the tower's features for the first layers
    # (layers, ids, hidden), set with ``features``.
    deepstack: Any = field(default=None, repr=False)

    def parts(self) -> list[tuple[int, int]]:
        """(first id index, ids) of each part the tower encodes in one call."""
        if not self.spans:
            return [(0, len(self.ids))]
        out, at = [], 0
        for n in self.spans:
            out.append((at, n))
            at += n
        return out


@dataclass
class Processor:
    """What the intake thread needs of a vision model: its processor and markers."""

    processor: Any
    # The text the chat template writes for an image, which the processor expands.
    marker: str
    # The token id every image token has before mlxd renumbers it.
    placeholder: int


def processor_parts(processor: Any) -> Processor:
    """The processor's image marker and image token id."""
    marker = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None)
    token_id = getattr(processor, "image_token_id", None)
    tokenizer = getattr(processor, "tokenizer", processor)
    image_token = getattr(processor, "image_token", None)
    if token_id is None and image_token is not None:
        token_id = tokenizer.convert_tokens_to_ids(image_token)
    if not marker or token_id is None:
        raise ValueError("the model's processor names no image token")
    return Processor(processor, str(marker), int(token_id))


def is_virtual(token: int) -> bool:
    return token >= VIRTUAL_BASE


def _content(message: dict, marker: str | None) -> Any:
    """A message's content list for the template: text and image parts (or one string)."""
    content = message.get("content")
    if not isinstance(content, list):
        return content
    if marker is None:
        return [
            {"type": "image"}
            if p.get("type") == IMAGE_PART
            else {"type": "text", "text": p["text"]}
            for p in content
        ]
    return "".join(marker if p.get("type") == IMAGE_PART else p["text"] for p in content)


def render(tokenizer: Any, prompt: ChatPrompt, marker: str, count: int) -> str:
    """The messages through the chat template, with one ``marker`` per image.

    A template that takes content lists (the models' own do) renders the
    image parts itself; one that does not, or that dropped them, gets the
    markers inline in string contents.
    """
    kwargs: dict[str, Any] = dict(prompt.template_kwargs)
    if prompt.tools:
        kwargs["tools"] = [dict(t) for t in prompt.tools]
    for inline in (None, marker):
        messages = [{**m, "content": _content(m, inline)} for m in prompt.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as exc:
            if inline is None:
                continue
            raise IntakeError(
                f"the model's chat template rejected these messages: {exc}", param="messages"
            ) from exc
        if text.count(marker) == count:
            return text
    raise IntakeError(
        "the model's chat template does not place the images (it wrote a different number "
        f"of {marker!r} markers than there are images)",
        param="messages",
    )


def tokenize_images(
    parts: Processor, tokenizer: Any, prompt: ChatPrompt
) -> tuple[list[int], ImageSet]:
    """The prompt's token ids (image tokens as virtual ids) and its images.

    Raises:
        IntakeError: an image cannot be decoded, or the template or the
            processor cannot take the prompt.
    """
    try:
        pictures = [decode(part) for part in prompt.images]
    except ImageError as exc:
        raise IntakeError(f"{exc.param}: {exc}", code="invalid_image", param=exc.param) from exc
    text = render(tokenizer, prompt, parts.marker, len(pictures))
    try:
        out = parts.processor(text=[text], images=pictures, return_tensors="np")
    except Exception as exc:
        where = prompt.images[0].where
        raise IntakeError(
            f"{where}: the model's processor cannot take these images: {exc}",
            code="invalid_image",
            param=where,
        ) from exc
    ids = [int(t) for t in np.asarray(out["input_ids"])[0].tolist()]
    inputs = {
        k: np.asarray(v)
        for k, v in out.items()
        if k not in ("input_ids", "attention_mask") and v is not None
    }
    positions = [i for i, t in enumerate(ids) if t == parts.placeholder]
    if not positions:
        raise IntakeError(
            "the model's processor wrote no image tokens for these images",
            param=prompt.images[0].where,
        )
    digests = _digests(inputs, positions, len(pictures))
    virtual = []
    for (digest, index), pos in zip(digests, positions, strict=True):
        vid = VIRTUAL_BASE + _id_hash(digest, index)
        ids[pos] = vid
        virtual.append(vid)
    key = hashlib.sha256(b"".join(d + i.to_bytes(4, "little") for d, i in digests)).hexdigest()
    runs = _runs(positions)
    per_image = _per_image(inputs, len(pictures))
    alone = per_image is not None and len(runs) == len(pictures)
    spans = tuple(len(r) for r in runs) if alone else ()
    images = ImageSet(key, tuple(virtual), parts.placeholder, inputs, len(pictures), spans)
    images.per_image = per_image if alone else None
    grids = mrope_layout.grids(inputs, _merge(parts.processor))
    if grids is not None:
        try:
            images.places = mrope_layout.token_places(grids, runs, ids)
        except ValueError as exc:
            raise IntakeError(
                f"the model's processor gave an image grid that does not match its tokens: {exc}",
                param=prompt.images[0].where,
            ) from exc
    return ids, images


def _merge(processor: Any) -> int:
    """The spatial merge of a Qwen-VL image processor (tokens are merge x merge patches)."""
    return int(getattr(getattr(processor, "image_processor", None), "merge_size", 1) or 1)


def _per_image(inputs: dict[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]] | None:
    """The processor's inputs, one dict per image, or None when they hold the images jointly."""
    pixels = inputs.get("pixel_values")
    if pixels is None:
        return None
    if len(inputs) == 1 and pixels.shape[0] == count:
        return [{"pixel_values": pixels[i : i + 1]} for i in range(count)]
    return mrope_layout.split_inputs(inputs)


def _digest(*arrays: np.ndarray) -> bytes:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.digest()


def _runs(positions: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _digests(
    inputs: dict[str, np.ndarray], positions: list[int], count: int
) -> list[tuple[bytes, int]]:
    """For every image token: the hash of its image's inputs and its index in the image."""
    runs = _runs(positions)
    per_image = _per_image(inputs, count)
    if per_image is not None and len(runs) == len(per_image):
        out = []
        for own, run in zip(per_image, runs, strict=True):
            arrays = [own[k] for k in sorted(own)]
            if len(arrays) == 1:  # pixels alone: the image's own array, as mlxd always hashed it
                arrays = [arrays[0][0]]
            digest = _digest(*arrays)
            out.extend((digest, i) for i in range(len(run)))
        return out
    # Several runs per image, or more inputs than pixels: one hash for all the images.
    digest = _digest(*(inputs[k] for k in sorted(inputs)))
    return [(digest, i) for i in range(len(positions))]


def _id_hash(digest: bytes, index: int) -> int:
    h = hashlib.blake2b(digest + index.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(h, "little") % VIRTUAL_BASE


def decode_text(tokenizer: Any, ids: list[int]) -> str:
    """``ids`` as text, each run of an image's virtual ids shown as ``[image]``."""
    out: list[str] = []
    run: list[int] = []
    image = False
    for t in ids:
        if t >= VIRTUAL_BASE:
            if run:
                out.append(tokenizer.decode(run))
                run = []
            if not image:
                out.append("[image]")
            image = True
        else:
            run.append(t)
            image = False
    if run:
        out.append(tokenizer.decode(run))
    return "".join(out)
