"""``mode = "mtp"``: the MTP head's weights, read from the target's own checkpoint at load.

mlx-lm's ``sanitize`` drops the MTP layer when it loads the target; this
reads those tensors back from the same safetensors files (only the shards
that hold them) and loads them into the head's module: DeepSeek-V3's and GLM's
``model.layers.<N>.*`` through the target's own ``sanitize`` (expert
stacking) as if they were layer 0, into a :class:`~.mtp_head.NextN`;
Qwen3.5's and Qwen3-Next's ``mtp.*`` (norms shifted, experts split or
stacked, as mlx-lm does for the target) into a :class:`~.mtp_head.QwenMtp`.
The head's bytes count in the target's ``weights_bytes``, so the memory
budget holds both. A model that cannot run
an MTP head is refused with the reason, naming it: the load fails (first
load or reload), never a step.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.config import SpeculativeSettings
from mlxd.engine.chat.loading import LoadedModel, ModelLoadError
from mlxd.engine.chat.speculative.mtp_head import (
    NEXTN_FAMILIES,
    QWEN_FAMILIES,
    MtpHead,
    NextN,
    QwenMtp,
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
        raise _refused(
            name,
            "is served through mlx-vlm; MTP heads are read for text models only "
            "(serve it as text: [model] vision = false)",
        )
    families = (*NEXTN_FAMILIES, *QWEN_FAMILIES)
    if info.family not in families:
        raise _refused(
            name,
            f"is a {info.family!r} model: mlxd runs the MTP heads of "
            f"{', '.join(families)} checkpoints only (docs/batching.md#mtp-heads); "
            'use mode = "prompt_lookup" or "draft"',
        )
    model = loaded.model
    path = Path(info.path)
    if _config(path).get("num_nextn_predict_layers") == 0:  # Kimi K2: DeepSeek-V3 without MTP
        raise _refused(
            name,
            f"has no MTP layer (its config.json sets num_nextn_predict_layers = 0, in {path}); "
            'use mode = "prompt_lookup" or "draft"',
        )
    qwen = info.family in QWEN_FAMILIES
    prefix = "mtp." if qwen else f"model.layers.{int(model.args.num_hidden_layers)}."
    tensors = _read(path, prefix)
    if not tensors:
        raise _refused(
            name,
            f"has no MTP weights ({prefix}* in {path}); converted checkpoints "
            "(mlx_lm.convert, most mlx-community uploads) drop them: serve the original "
            'checkpoint, or use mode = "prompt_lookup"',
        )
    try:
        module, layers = _module(model, info.family, path, tensors, prefix)
    except Exception as exc:  # a layout this build does not know: the load says so
        raise _refused(name, f"has MTP weights this build cannot read: {exc}") from exc
    trunk, head, embed = target_parts(model)
    return MtpHead(module, trunk, head, embed, info.family, nbytes(module), layers)


def _module(
    model: Any, family: str, path: Path, tensors: dict[str, mx.array], prefix: str
) -> tuple[NextN | QwenMtp, int]:
    """The head's module with ``tensors`` loaded (strictly), and its decoder layer count."""
    layers = 1
    if family in QWEN_FAMILIES:
        weights = _qwen_weights(tensors, hf_layout=_unsanitized(path, family))
        layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
        args = getattr(model, "language_model", model).args
        module: NextN | QwenMtp = QwenMtp(args, layers, family)
    else:
        weights = _nextn_weights(model, tensors, prefix)
        module = nextn_module(model)
    quantization = _config(path).get("quantization")
    if quantization and any(k.endswith(".scales") for k in weights):
        nn.quantize(
            module,
            group_size=int(quantization.get("group_size", 64)),
            bits=int(quantization.get("bits", 4)),
            class_predicate=lambda p, _m: f"{p}.scales" in weights,
        )
    module.load_weights(list(weights.items()), strict=True)
    module.eval()
    mx.eval(module.parameters())
    return module, layers


def _nextn_weights(model: Any, tensors: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """``model.layers.<N>.*`` as :class:`NextN`'s, through the target's own sanitize."""
    as_first = {f"model.layers.0.{k[len(prefix) :]}": v for k, v in tensors.items()}
    weights: dict[str, mx.array] = {}
    for key, value in model.sanitize(as_first).items():
        rest = key.removeprefix("model.layers.0.")
        if rest.startswith(_SHARED):
            continue
        weights[rest if rest.startswith(_OWN) else f"block.{rest}"] = value
    return weights


def _qwen_weights(tensors: dict[str, mx.array], *, hf_layout: bool) -> dict[str, mx.array]:
    """``mtp.*`` as :class:`QwenMtp`'s: norms shifted (Hugging Face layout), experts split."""
    out: dict[str, mx.array] = {}
    for key, value in tensors.items():
        rest = key.removeprefix("mtp.")
        if hf_layout and rest.endswith("norm.weight") and value.ndim == 1:
            value = value + 1.0  # Qwen3.5 stores RMSNorm scales around 0
        out[rest] = value
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:  # Qwen3.5 MoE
        at = key.removesuffix(".experts.gate_up_proj")
        gate_up = out.pop(key)
        mid = gate_up.shape[-2] // 2
        out[f"{at}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{at}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{at}.switch_mlp.down_proj.weight"] = out.pop(f"{at}.experts.down_proj")
    experts: dict[tuple[str, str], dict[int, str]] = {}  # Qwen3-Next: one by one
    for key in out:
        if match := _EXPERT.fullmatch(key):
            at, e, proj, leaf = match.groups()
            experts.setdefault((at, f"{proj}.{leaf}"), {})[int(e)] = key
    for (at, leaf), keys in experts.items():
        out[f"{at}.switch_mlp.{leaf}"] = mx.stack([out.pop(keys[e]) for e in sorted(keys)])
    return out


_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)")


def _unsanitized(path: Path, family: str) -> bool:
    """Whether the checkpoint is in the Hugging Face layout, as the target's sanitize tells it.

    mlx-lm shifts the norms of a Qwen3.5 checkpoint whose conv1d weights are
    unsanitized, and of a Qwen3-Next one whose experts are unstacked.
    """
    if family == "qwen3_next":
        return bool(_read(path, "model.layers.", lambda k: ".mlp.experts.0." in k, first=True))
    conv = _read(path, "", lambda key: "conv1d.weight" in key, first=True)
    return any(v.shape[-1] != 1 for v in conv.values())


def _config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _read(
    path: Path,
    prefix: str,
    where: Callable[[str], bool] | None = None,
    *,
    first: bool = False,
) -> dict[str, mx.array]:
    """The checkpoint's tensors under ``prefix`` (and ``where``), lazily read; ``first``: one."""

    def wanted(key: str) -> bool:
        return key.startswith(prefix) and (where is None or where(key))

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for k, f in weight_map.items() if wanted(k)})
    else:
        files = sorted(path.glob("*.safetensors"))
    out: dict[str, mx.array] = {}
    for file in files:
        arrays = mx.load(str(file))
        assert isinstance(arrays, dict)
        out.update({k: v for k, v in arrays.items() if wanted(k)})
        if first and out:
            break
    return out
