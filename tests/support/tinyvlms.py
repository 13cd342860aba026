"""Tiny random-weight vision-language models, built offline with mlx-vlm's own classes.

The counterpart of :mod:`tests.support.tinymodels` for images: each family is built from a
config with mlx-vlm's model classes, saved as an ordinary mlx-vlm model directory
(``config.json``, ``model.safetensors``, the tokenizer of tinymodels with the family's image
tokens added, ``preprocessor_config.json`` and ``processor_config.json`` for the family's
processor) and loaded by tests with the real ``mlx_vlm.load(path)`` (through mlxd's loader).

- ``llava``: a CLIP vision tower (28x28 images, patch 14: 4 image tokens) over the tinymodels
  llama (4 full-attention layers); ``<image>`` in the prompt.
- ``gemma3``: a SigLIP vision tower (28x28, patch 14, 4 soft tokens per image) over the
  tinymodels gemma3 text model (sliding-window and global layers); ``<start_of_image>``.

Both templates are ChatML that renders content lists (text and image parts), as the
families' own templates do. Use :func:`tiny_vlm_dir` for a cached build.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from tests.support import tinymodels as tm

CONTENT_VERSION = "v1"
IMAGE_SIZE = 28
# Qwen-VL images are resized to multiples of 28 pixels within these bounds: 56x56 is 4
# image tokens (a 2x2 grid after the 2x2 merge), 112x56 is 8.
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 112 * 112

_MEAN = [0.5, 0.5, 0.5]
_STD = [0.5, 0.5, 0.5]


def _template(image: str) -> str:
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- elif message['content'] %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' %}{{- '" + image + "' }}"
        "{%- else %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

_FAMILIES: dict[str, dict[str, Any]] = {
    "llava": {
        "added": ("<image>",),
        "marker": "<image>",
        "text": "llama",
    },
    "gemma3": {
        "added": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        "marker": "<start_of_image>",
        "text": "gemma3_text",
    },
    "qwen2_vl": {
        "added": _QWEN_TOKENS,
        "marker": "<|vision_start|><|image_pad|><|vision_end|>",
        "text": "llama",
    },
    "qwen2_5_vl": {
        "added": _QWEN_TOKENS,
        "marker": "<|vision_start|><|image_pad|><|vision_end|>",
        "text": "llama",
    },
    "qwen3_vl": {
        "added": _QWEN_TOKENS,
        "marker": "<|vision_start|><|image_pad|><|vision_end|>",
        "text": "llama",
    },
    "qwen3_5": {
        "added": _QWEN_TOKENS,
        "marker": "<|vision_start|><|image_pad|><|vision_end|>",
        "text": "qwen3_5",
    },
}
for _moe, _base in (("qwen3_vl_moe", "qwen3_vl"), ("qwen3_5_moe", "qwen3_5")):
    _FAMILIES[_moe] = _FAMILIES[_base]
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Mixture of experts: 4 experts of 32, 2 a token (and Qwen3.5's shared expert).
_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [],
}

FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def _config(family: str) -> dict[str, Any]:
    spec = _FAMILIES[family]
    added = spec["added"]
    ids = tm._special_ids(added)
    vocab = tm._vocab_size(added)
    text = {**tm._FAMILY_CONFIGS[spec["text"]], "vocab_size": vocab}
    eos = ids[tm.EOS_TOKEN]
    if family == "llava":
        return {
            "model_type": "llava",
            "text_config": text,
            "vision_config": {
                "model_type": "clip_vision_model",
                "num_hidden_layers": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 2,
                "image_size": IMAGE_SIZE,
                "patch_size": 14,
                "projection_dim": 32,
            },
            "image_token_index": ids["<image>"],
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "vocab_size": vocab,
            "eos_token_id": eos,
        }
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen2_vl_config(family, text, ids, eos)
    if family.startswith("qwen3"):
        return _qwen3_config(family, text, ids, eos)
    text = {**text, "model_type": "gemma3_text", "mm_tokens_per_image": 4}
    text.pop("rope_theta", None)
    return {
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": IMAGE_SIZE,
        },
        "mm_tokens_per_image": 4,
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "hidden_size": text["hidden_size"],
        "pad_token_id": ids[tm.PAD_TOKEN],
        "vocab_size": vocab,
        "eos_token_id": eos,
    }


def _qwen_ids(ids: dict[str, int], eos: int) -> dict[str, Any]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": None,
        "eos_token_id": eos,
    }


def _qwen2_vl_config(
    family: str, text: dict[str, Any], ids: dict[str, int], eos: int
) -> dict[str, Any]:
    # Qwen2-VL and Qwen2.5-VL keep their text settings at the top level; 16-wide heads:
    # 8 rotary frequencies split 2/3/3 over time, height and width.
    vision: dict[str, Any] = {
        "model_type": family,
        "depth": 2,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    if family == "qwen2_vl":
        vision |= {"embed_dim": 32, "hidden_size": text["hidden_size"], "mlp_ratio": 2}
    else:  # windowed attention: 2x2-token windows, the last block full
        vision |= {
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": text["hidden_size"],
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
    return {
        **{k: v for k, v in text.items() if k != "head_dim"},
        "model_type": family,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": vision,
        **_qwen_ids(ids, eos),
    }


def _qwen3_config(
    family: str, text: dict[str, Any], ids: dict[str, int], eos: int
) -> dict[str, Any]:
    # Qwen3-VL: a llama-like language model whose first two layers take the vision tower's
    # intermediate features (deepstack). Qwen3.5: natively multimodal, hybrid (linear and
    # full attention), 8 rotary dims (4 frequencies).
    vision = {
        "model_type": family,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1] if family.startswith("qwen3_vl") else [],
    }
    if family.endswith("_moe"):
        text = {**text, **_MOE, "model_type": family}
    if family.startswith("qwen3_vl"):
        mrope = {"type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        text = {**text, "model_type": family, "rope_scaling": mrope}
    else:
        text = {**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": [2, 1, 1]}}
    return {
        "model_type": family,
        "text_config": {**text, "eos_token_id": eos},
        "vision_config": vision,
        "vocab_size": text["vocab_size"],
        **_qwen_ids(ids, eos),
    }


def _processor_files(family: str) -> dict[str, dict[str, Any]]:
    if family in QWEN_FAMILIES:
        processor = {
            "qwen3_5": "Qwen3VLProcessor",
            "qwen3_5_moe": "Qwen3VLProcessor",
            "qwen3_vl": "Qwen3VLProcessor",
            "qwen3_vl_moe": "Qwen3VLProcessor",
            "qwen2_5_vl": "Qwen2_5_VLProcessor",
        }
        return {
            "preprocessor_config.json": {
                "image_processor_type": "Qwen2VLImageProcessor",
                "min_pixels": QWEN_MIN_PIXELS,
                "max_pixels": QWEN_MAX_PIXELS,
                "patch_size": 14,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "image_mean": _MEAN,
                "image_std": _STD,
                "do_rescale": True,
                "do_normalize": True,
                "do_convert_rgb": True,
                "rescale_factor": 1 / 255,
            },
            "processor_config.json": {"processor_class": processor.get(family, "Qwen2VLProcessor")},
        }
    if family == "llava":
        return {
            "preprocessor_config.json": {
                "image_processor_type": "CLIPImageProcessor",
                "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                "size": {"shortest_edge": IMAGE_SIZE},
                "do_center_crop": True,
                "do_resize": True,
                "do_normalize": True,
                "do_rescale": True,
                "do_convert_rgb": True,
                "image_mean": _MEAN,
                "image_std": _STD,
                "resample": 3,
                "rescale_factor": 1 / 255,
            },
            "processor_config.json": {
                "processor_class": "LlavaProcessor",
                "patch_size": 14,
                "vision_feature_select_strategy": "default",
                "num_additional_image_tokens": 1,
            },
        }
    return {
        "preprocessor_config.json": {
            "image_processor_type": "SiglipImageProcessor",
            "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_resize": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_convert_rgb": True,
            "image_mean": _MEAN,
            "image_std": _STD,
            "resample": 2,
            "rescale_factor": 1 / 255,
        },
        "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": 4},
    }


def _tokenizer_config(family: str) -> dict[str, Any]:
    added = _FAMILIES[family]["added"]
    ids = tm._special_ids(added)
    config = tm._tokenizer_config("chatml")
    config["chat_template"] = _template(_FAMILIES[family]["marker"])
    config["added_tokens_decoder"] = tm.added_tokens_decoder(ids)
    if family == "gemma3":
        config["extra_special_tokens"] = {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
    return config


def build_tiny_vlm(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a random-weight mlx-vlm model directory for ``family`` into ``out_dir``."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(family)
    module, _ = get_model_and_args(config)
    model_config = update_module_configs(
        module.ModelConfig.from_dict(config), module, config, ["text", "vision"]
    )
    model = module.Model(model_config)
    params = dict(tree_flatten(model.parameters()))
    weights = tm._random_weights(params, tm._rng_for(f"vlm-{family}", seed))
    head = next((w for n, w in weights.items() if n.endswith("lm_head.weight")), None)
    if head is not None:
        head[config["eos_token_id"]] *= tm._EOS_ROW_SCALE
    arrays = {name: mx.array(w) for name, w in weights.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer.json").write_text(tm._tokenizer_json_with(_FAMILIES[family]["added"]))
    tokenizer_config = _tokenizer_config(family)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(tokenizer_config["chat_template"] + "\n")
    for name, body in _processor_files(family).items():
        (out_dir / name).write_text(json.dumps(body, indent=2) + "\n")
    return out_dir


def _content_key(family: str) -> str:
    import mlx_vlm

    blob = json.dumps(
        {
            "version": CONTENT_VERSION,
            "config": _config(family),
            "processor": _processor_files(family),
            "tokenizer": _tokenizer_config(family),
            "corpus": tm._CORPUS,
            "mlx": mx.__version__,
            "mlx_vlm": mlx_vlm.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_vlm_dir(family: str, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """A cached build of ``family`` (built once per content key, renamed into place)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown tiny VLM family {family!r}; one of {FAMILIES}")
    root = (Path(cache_dir) if cache_dir is not None else tm.cache_root()) / "vlm"
    final = root / f"{family}-{seed}-{_content_key(family)}"
    return tm.build_once(final, lambda tmp: build_tiny_vlm(family, tmp, seed=seed))
