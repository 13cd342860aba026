"""Which model directories are vision-language models, and loading one through mlx-vlm.

mlx-vlm is an optional dependency (the ``embeddings`` extra pulls it): it is
imported when a vision model loads, and its absence is an error that names
the install command. Runs on the engine thread (loading creates MLX state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_config, load_tokenizer

from mlxd.config import ModelSettings
from mlxd.engine.chat.mrope import MropeVisionLM
from mlxd.engine.chat.mrope_layout import is_mrope
from mlxd.engine.chat.vision import VisionLM
from mlxd.engine.chat.vision_intake import Processor, processor_parts

INSTALL_HINT = "pip install 'mlxd[embeddings]'"


class VisionLoadError(Exception):
    """mlx-vlm is missing or cannot load the model; the message says what to do."""


def load_vlm(path: str) -> tuple[Any, Any]:
    """``mlx_vlm.load(path)``: the model and its processor.

    Raises:
        VisionLoadError: mlx-vlm is not installed (with the install command),
            or it cannot load this directory.
    """
    try:
        from mlx_vlm.utils import load
    except ImportError as exc:
        raise VisionLoadError(
            f"this model is a vision-language model, which needs mlx-vlm: {INSTALL_HINT} "
            f"(or set vision = false to serve it as text only) ({exc})"
        ) from exc
    try:
        return load(path)
    except Exception as exc:
        raise VisionLoadError(f"mlx_vlm.load({path!r}) failed: {exc}") from exc


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def wants_vision(settings: ModelSettings, path: Path) -> bool:
    """Load through mlx-vlm: ``vision = true``, or unset, a vision part in the config
    and an image processor beside it (a text-only conversion keeps no processor)."""
    if settings.vision is not None:
        return settings.vision
    has_processor = any(
        (path / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")
    )
    return has_processor and isinstance(_config(path).get("vision_config"), dict)


def vision_unsupported(path: Path) -> str | None:
    """Why mlxd's vision path cannot serve this model's images, or None.

    Multimodal rotary positions give image tokens 3-D positions: mlxd keeps
    them per row for the Qwen-VL families (:mod:`mlxd.engine.chat.mrope`);
    another family with them (GLM-4V, ...) is refused.
    """
    config = _config(path)
    if "mrope" in json.dumps(config) and not is_mrope(config):
        return "its language model uses multimodal rotary positions (mrope), not supported yet"
    return None


def load_vision(path: Path, overrides: dict[str, Any]) -> tuple[Any, Any, dict, Processor]:
    """A vision-language model through mlx-vlm, its language model shaped for mlx-lm.

    Returns the model (a :class:`VisionLM`), mlx-lm's tokenizer wrapper, the
    config and the processor's parts for intake.

    Raises:
        VisionLoadError: mlx-vlm is missing, cannot load the directory, or
            the model is of a kind mlxd cannot serve images for.
    """
    why = vision_unsupported(path)
    if why is not None:
        raise VisionLoadError(f"{path} cannot take images in mlxd: {why}; set vision = false")
    try:
        vlm, processor = load_vlm(str(path))
        model = MropeVisionLM(vlm) if is_mrope(_config(path)) else VisionLM(vlm)
        model.make_cache()  # refuses a language model whose caches mlxd cannot batch
        parts = processor_parts(processor)
    except ValueError as exc:
        raise VisionLoadError(str(exc)) from exc
    config = load_config(path)
    eos = config.get("eos_token_id") or (config.get("text_config") or {}).get("eos_token_id")
    tokenizer = load_tokenizer(
        path, overrides, eos_token_ids=[eos] if isinstance(eos, int) else eos
    )
    return model, tokenizer, config, parts
