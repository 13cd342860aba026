"""Tiny random-weight models that carry an MTP layer, for MTP tests.

DeepSeek-V3 (``deepseek_v3``), DeepSeek-V3.2 (``deepseek_v32``), GLM-4.5 (``glm4_moe``) and
GLM-4.7-Flash (``glm4_moe_lite``) checkpoints keep their multi-token-prediction layer as one
more decoder layer,
``model.layers.<num_hidden_layers>.*``, with ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.{norm,head}`` and its own ``embed_tokens`` beside the usual attention and MoE
weights (experts unstacked, as in Hugging Face checkpoints). mlx-lm's ``sanitize`` drops
that layer at load; mlxd's ``mode = "mtp"`` reads it back.

mlx-lm's ``deepseek_v3`` drops the layer by its number in the real checkpoints
(``model.layers.61``), not by ``num_hidden_layers``: a tiny two-layer DeepSeek-V3 keeps its
``model.layers.2.*`` in ``mtp.safetensors``, a file mlx-lm's loader (``model*.safetensors``)
does not read and mlxd's MTP loader does (every ``*.safetensors``). A 61-layer tiny model
would take about 70 ms a step on this CPU.

Two variants (``echo``):

- ``False``: every weight random. The MTP layer's guesses are mostly wrong: the mechanics
  (drafting, verifying, rolling back) run, and greedy output must not change.
- ``True``: a bigram model. Every attention output and MLP down projection is zero, so
  the target's next token depends on the current token alone, ``f(x)``, and the MTP layer
  (its ``eh_proj`` passing the token embedding through, its block zeroed likewise) predicts
  ``f(x_next)``: exactly what the target will choose after it. Drafts are accepted nearly
  always, which proves that drafts, hidden states and positions line up.

Built into the tiny-model cache (:func:`tiny_mtp_dir`); nothing is committed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tests.support.tinymodels import (
    CONTENT_VERSION,
    EOS_TOKEN,
    PAD_TOKEN,
    _content_key,
    _random_weights,
    _special_ids,
    _tokenizer_config,
    _tokenizer_json_with,
    _vocab_size,
    build_once,
    cache_root,
)

LAYERS = 2
EXPERTS = 4
# Bump when a builder below changes what it writes (the cache keys hash this).
_BUILD = "4"

_MOE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 4096,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "n_routed_experts": EXPERTS,
    "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "num_hidden_layers": LAYERS,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}
_MLA: dict[str, Any] = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}

# The families mlxd reads the MTP layer of (mlxd.engine.chat.speculative.mtp_head).
CONFIGS: dict[str, dict[str, Any]] = {
    "glm4_moe": {
        **_MOE,
        "model_type": "glm4_moe",
        "head_dim": 16,
        "use_qk_norm": False,
        "partial_rotary_factor": 0.5,
    },
    "glm4_moe_lite": {**_MOE, **_MLA, "model_type": "glm4_moe_lite"},
    "deepseek_v3": {**_MOE, **_MLA, "model_type": "deepseek_v3"},
    # index_topk below the tests' lengths: the sparse attention selects.
    "deepseek_v32": {
        **_MOE,
        **_MLA,
        "model_type": "deepseek_v32",
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
    },
}
# Where a family's MTP layer is written when mlx-lm's loader would not drop it (above).
_MTP_FILE = {"deepseek_v3": "mtp.safetensors"}
MTP_FAMILIES = tuple(CONFIGS)


def mtp_config(family: str = "glm4_moe") -> dict[str, Any]:
    ids = _special_ids()
    return {
        **CONFIGS[family],
        "vocab_size": _vocab_size(),
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "bos_token_id": None,
    }


def _silenced(name: str) -> bool:
    """Weights zeroed in the echo variant: what a layer adds to its residual stream."""
    return name.endswith(_RESIDUAL)


def build_tiny_mtp_model(
    out_dir: Path, *, family: str = "glm4_moe", echo: bool = False, with_mtp: bool = True
) -> Path:
    """Write the model directory (``with_mtp=False``: without its MTP layer) into ``out_dir``."""
    from mlx.utils import tree_flatten

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = mtp_config(family)
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    params = dict(tree_flatten(model.parameters()))
    seed = hashlib.sha256(f"mtp:{family}:{echo}".encode()).hexdigest()[:8]
    rng = np.random.default_rng(int(seed, 16))
    weights = _random_weights(params, rng)
    head = weights["lm_head.weight"]
    head[config["eos_token_id"]] *= 0.5  # rows run to max_tokens, as tinymodels' do
    if with_mtp:
        weights.update(_mtp_layer(module, args, rng, weights, echo=echo))
    if echo:
        for name, w in weights.items():
            if _silenced(name):
                w[...] = 0.0
    arrays = {name: mx.array(w) for name, w in weights.items()}
    apart = _MTP_FILE.get(family)
    if with_mtp and apart:
        layer = f"model.layers.{args.num_hidden_layers}."
        mtp = {k: arrays.pop(k) for k in [k for k in arrays if k.startswith(layer)]}
        mx.save_safetensors(str(out_dir / apart), mtp, metadata={"format": "pt"})
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer.json").write_text(_tokenizer_json_with(()))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2))
    return out_dir


def _mtp_layer(
    module: Any, args: Any, rng: np.random.Generator, target: dict[str, np.ndarray], *, echo: bool
) -> dict[str, np.ndarray]:
    """``model.layers.<N>.*`` in the Hugging Face layout (experts one by one, MLA's fused
    ``kv_b_proj``)."""
    from mlx.utils import tree_flatten

    from mlxd.engine.chat.speculative.mtp_head import NEXTN_FAMILIES

    n = args.num_hidden_layers
    layer = getattr(module, NEXTN_FAMILIES[args.model_type])(args, n)
    block = dict(tree_flatten(layer.parameters()))
    drawn = _random_weights(block, rng)
    out: dict[str, np.ndarray] = {}
    for name, w in drawn.items():
        if ".switch_mlp." in name:  # unstack: mlx-lm's sanitize stacks them again
            proj = name.split(".switch_mlp.")[1]
            for e in range(w.shape[0]):
                out[f"mlp.experts.{e}.{proj}"] = w[e]
        else:
            out[name] = w
    if "self_attn.embed_q.weight" in out:  # MLA: fuse back into Hugging Face's kv_b_proj
        wk, wv = out.pop("self_attn.embed_q.weight"), out.pop("self_attn.unembed_out.weight")
        fused = np.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        out["self_attn.kv_b_proj.weight"] = fused.reshape(-1, fused.shape[-1])
    size = args.hidden_size
    out["enorm.weight"] = np.ones(size, np.float32)
    out["hnorm.weight"] = np.ones(size, np.float32)
    out["shared_head.norm.weight"] = np.ones(size, np.float32)
    if echo:  # [embedding | hidden] -> embedding
        out["eh_proj.weight"] = np.concatenate(
            [np.eye(size), np.zeros((size, size))], axis=1
        ).astype(np.float32)
    else:
        out["eh_proj.weight"] = rng.normal(0.0, 2.0 / np.sqrt(2 * size), (size, 2 * size)).astype(
            np.float32
        )
    out["embed_tokens.weight"] = target["model.embed_tokens.weight"].copy()
    out["shared_head.head.weight"] = target["lm_head.weight"].copy()
    return {f"model.layers.{n}.{k}": v for k, v in out.items()}


def tiny_mtp_dir(family: str = "glm4_moe", *, echo: bool = False, with_mtp: bool = True) -> Path:
    """A cached build (see :func:`tests.support.tinymodels.tiny_model_dir`)."""
    # _content_key covers the tokenizer, corpus and the mlx / mlx-lm versions.
    blob = json.dumps(
        [_BUILD, CONFIGS[family], echo, with_mtp, _content_key("llama")], sort_keys=True
    )
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    name = f"{family}_mtp-{'echo' if echo else 'random'}-{'mtp' if with_mtp else 'none'}-{key}"
    final = cache_root() / CONTENT_VERSION / name
    return build_once(
        final,
        lambda tmp: build_tiny_mtp_model(tmp, family=family, echo=echo, with_mtp=with_mtp),
    )


def build_tiny_qwen_mtp_model(
    out_dir: Path, *, family: str = "qwen3_5", echo: bool = False
) -> Path:
    """tinymodels' ``qwen3_5`` or ``qwen3_next`` (hybrid: gated-delta and full attention)
    with ``mtp.*`` added.

    ``echo`` zeroes what every layer adds to its residual stream (the gated-delta
    ``out_proj`` too) and makes ``fc`` pass the token embedding through, as above.
    """
    from mlx.utils import tree_flatten

    from mlxd.engine.chat.speculative.mtp_head import QwenMtp
    from tests.support.tinymodels import build_tiny_model

    out_dir = build_tiny_model(family, Path(out_dir))
    config = json.loads((out_dir / "config.json").read_text())
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args_class = getattr(module, "TextModelArgs", None) or module.ModelArgs
    if family == "qwen3_next":
        # mlx-lm reads a Qwen3-Next checkpoint's mtp.* (to drop it) only in the Hugging
        # Face layout, which it tells by unstacked experts: a MoE target, written so.
        config.update(_QWEN_NEXT_MOE)
        _write_moe_target(out_dir, module, args_class.from_dict(config))
    args = args_class.from_dict(config)
    head = dict(tree_flatten(QwenMtp(args, 1, family).parameters()))
    seed = hashlib.sha256(f"{family}-mtp:{echo}".encode()).hexdigest()[:8]
    weights = {
        f"mtp.{k}": v
        for k, v in _random_weights(head, np.random.default_rng(int(seed, 16))).items()
    }
    for name in [n for n in weights if ".switch_mlp." in n]:  # experts one by one, as HF
        at, proj = name.split(".switch_mlp.")
        stacked = weights.pop(name)
        weights.update({f"{at}.experts.{e}.{proj}": stacked[e] for e in range(len(stacked))})
    size = args.hidden_size
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        weights[name] = np.ones(size, np.float32)  # _random_weights draws "embed" names
    if echo:
        weights["mtp.fc.weight"] = np.concatenate(
            [np.eye(size), np.zeros((size, size))], axis=1
        ).astype(np.float32)
    file = out_dir / "model.safetensors"
    loaded = mx.load(str(file))
    assert isinstance(loaded, dict)
    arrays = {**loaded, **{k: mx.array(v) for k, v in weights.items()}}
    if echo:
        arrays = {
            k: mx.zeros_like(v) if k.endswith(("out_proj.weight", *_RESIDUAL)) else v
            for k, v in arrays.items()
        }
    config["mtp_num_hidden_layers"] = 1
    mx.save_safetensors(str(file), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


_RESIDUAL = ("o_proj.weight", "down_proj.weight")

_QWEN_NEXT_MOE = {
    "num_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1,
}


def _write_moe_target(out_dir: Path, module: Any, args: Any) -> None:
    """Random MoE target weights, experts one by one (mlx-lm stacks them at load)."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(module.Model(args).parameters()))
    rng = np.random.default_rng(int(hashlib.sha256(b"qwen3_next-moe").hexdigest()[:8], 16))
    out: dict[str, mx.array] = {}
    for name, w in _random_weights(params, rng).items():
        if ".switch_mlp." in name:
            at, proj = name.split(".switch_mlp.")
            for e in range(w.shape[0]):
                out[f"{at}.experts.{e}.{proj}"] = mx.array(w[e])
        else:
            out[name] = mx.array(w)
    mx.save_safetensors(str(out_dir / "model.safetensors"), out, metadata={"format": "mlx"})


def tiny_qwen_mtp_dir(family: str = "qwen3_5", *, echo: bool = False) -> Path:
    """A cached build of :func:`build_tiny_qwen_mtp_model`."""
    from tests.support.tinymodels import family_config

    blob = json.dumps([_BUILD, family_config(family), echo, _content_key(family)], sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    name = f"{family}_mtp-{'echo' if echo else 'random'}-{key}"
    final = cache_root() / CONTENT_VERSION / name
    return build_once(final, lambda tmp: build_tiny_qwen_mtp_model(tmp, family=family, echo=echo))
