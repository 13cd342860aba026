"""``mode = "mtp"``: the MTP head's weights, read from the target's own checkpoint at load.

mlx-lm's ``sanitize`` drops the MTP layer when it loads the target; this
reads those tensors back from the same safetensors files (only the shards
that hold them), runs them through the target's own ``sanitize`` (expert
stacking, FP8 dequantization) as if they were layer 0, and loads them into
a :class:`~.mtp_head.NextN`. The head's bytes count in the target's
``weights_bytes``, so the memory budget holds both. A model that cannot run
an MTP head is refused with the reason, naming it: the load fails (first
load or reload), never a step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.config import SpeculativeSettings
from mlxd.engine.chat.loading import LoadedModel, ModelLoadError
from mlxd.engine.chat.speculative.mtp_head import (
    NEXTN_FAMILIES,
    MtpHead,
    nextn_module,
    target_parts,
)
from mlxd.engine.weights import nbytes

logger = logging.getLogger(__name__)

# Keys of the MTP layer that are copies of the target's own (not loaded).
_SHARED = ("embed_tokens.", "shared_head.head.")
# Keys of the MTP layer outside its decoder layer.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def attach_mtp(loaded: LoadedModel, settings: SpeculativeSettings) -> LoadedModel:
    """``loaded`` with its MTP head when ``settings`` ask for one, its bytes counted."""
    if settings.mode != "mtp":
        return loaded
    head = load_mtp(loaded)
    weights = loaded.weights_bytes + head.weights_bytes
    info = replace(loaded.info, weights_bytes=loaded.info.weights_bytes + head.weights_bytes)
    logger.info("loaded the MTP head of %s: %d MiB", loaded.info.id, head.weights_bytes // 2**20)
    return replace(loaded, draft=head, weights_bytes=weights, info=info)


def _refused(name: str, why: str) -> ModelLoadError:
    return ModelLoadError(f'[speculative] mode = "mtp": {name} {why}')


def load_mtp(loaded: LoadedModel) -> MtpHead:
    """The MTP head of ``loaded``'s checkpoint; raises ``ModelLoadError`` saying why not."""
    info = loaded.info
    name = repr(info.id)
    if loaded.vision is not None:
        raise _refused(name, "is served through mlx-vlm; MTP heads are read for text models only")
    if info.family not in NEXTN_FAMILIES:
        raise _refused(
            name,
            f"is a {info.family!r} model: mlxd runs the MTP heads of "
            f"{', '.join(NEXTN_FAMILIES)} checkpoints only (docs/batching.md#mtp-heads); "
            'use mode = "prompt_lookup" or "draft"',
        )
    model = loaded.model
    layer = int(model.args.num_hidden_layers)
    prefix = f"model.layers.{layer}."
    path = Path(info.path)
    tensors = _read(path, prefix)
    if not tensors:
        raise _refused(
            name,
            f"has no MTP weights ({prefix}* in {path}); converted checkpoints "
            "(mlx_lm.convert, most mlx-community uploads) drop them: serve the original "
            'checkpoint, or use mode = "prompt_lookup"',
        )
    as_first = {f"model.layers.0.{k[len(prefix) :]}": v for k, v in tensors.items()}
    weights: dict[str, mx.array] = {}
    for key, value in model.sanitize(as_first).items():
        rest = key.removeprefix("model.layers.0.")
        if rest.startswith(_SHARED):
            continue
        weights[rest if rest.startswith(_OWN) else f"block.{rest}"] = value
    module = nextn_module(model)
    quantization = _config(path).get("quantization")
    if quantization and any(k.endswith(".scales") for k in weights):
        nn.quantize(
            module,
            group_size=int(quantization.get("group_size", 64)),
            bits=int(quantization.get("bits", 4)),
            class_predicate=lambda p, _m: f"{p}.scales" in weights,
        )
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise _refused(name, f"has MTP weights this build cannot read: {exc}") from exc
    module.eval()
    mx.eval(module.parameters())
    trunk, head, embed = target_parts(model)
    return MtpHead(module, trunk, head, embed, info.family, nbytes(module))


def _config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _read(path: Path, prefix: str) -> dict[str, mx.array]:
    """Every tensor under ``prefix`` in the checkpoint's safetensors (lazily read)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for k, f in weight_map.items() if k.startswith(prefix)})
    else:
        files = sorted(path.glob("*.safetensors"))
    out: dict[str, mx.array] = {}
    for file in files:
        arrays = mx.load(str(file))
        assert isinstance(arrays, dict)
        out.update({k: v for k, v in arrays.items() if k.startswith(prefix)})
    return out
