"""A tiny random Gemma 4 text model and a tiny Gemma 4 assistant for it, for assistant tests.

The target is mlx-lm's ``gemma4_text`` (sliding-window and full-attention layers:
``RotatingKVCache`` and ``KVCache``), with a window shorter than the tests' rows.
The assistant directory has the layout of a Hugging Face ``gemma4_assistant``
checkpoint (``model.*``, ``pre_projection``, ``post_projection``, a tied head),
which mlx-vlm's reference drafter loads as well.

Two variants (``echo``), as tests/support/tinymtp.py's:

- ``False``: every weight random; the assistant's drafts are mostly rejected.
- ``True``: a bigram target (every attention output and MLP down projection zero,
  an untied head), and an assistant of the target's width whose ``pre_projection``
  passes the token embedding through, whose layers add nothing and whose head is
  the target's: it drafts exactly what the target will choose.

Built into the tiny-model cache; nothing is committed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tests.support.tinymodels import (
    CONTENT_VERSION,
    EOS_TOKEN,
    PAD_TOKEN,
    SLIDING_WINDOW,
    _content_key,
    _random_weights,
    _special_ids,
    _tokenizer_config,
    _tokenizer_json_with,
    _vocab_size,
    build_once,
    cache_root,
)

# Bump when a builder below changes what it writes (the cache keys hash this).
_BUILD = "2"
_SLIDING, _FULL = "sliding_attention", "full_attention"
_ROPE = {
    _FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
    _SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"},
}
_COMMON: dict[str, Any] = {
    "model_type": "gemma4_text",
    "head_dim": 16,
    "global_head_dim": 32,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": None,
    "attention_k_eq_v": False,
    "hidden_size_per_layer_input": 0,
    "sliding_window": SLIDING_WINDOW,
    "rope_parameters": _ROPE,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "enable_moe_block": False,
    "max_position_embeddings": 4096,
}
TARGET: dict[str, Any] = {
    **_COMMON,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_kv_shared_layers": 0,
    "layer_types": [_SLIDING, _FULL, _SLIDING, _FULL],
    "use_double_wide_mlp": False,
    "tie_word_embeddings": False,
}
_RESIDUAL = ("o_proj.weight", "down_proj.weight")


def target_config() -> dict[str, Any]:
    ids = _special_ids()
    vocab = _vocab_size()
    return {
        **TARGET,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "bos_token_id": None,
        "torch_dtype": "float32",
    }


def assistant_config(*, echo: bool = False, ordered: bool = False, **text: Any) -> dict[str, Any]:
    """The assistant's ``config.json``; ``text`` overrides its ``text_config``.

    ``ordered``: the E2B/E4B assistants' centroid-routed head (8 clusters, the best 2).
    """
    vocab = _vocab_size()
    return {
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": TARGET["hidden_size"],
        "use_ordered_embeddings": ordered,
        "num_centroids": 8,
        "centroid_intermediate_top_k": 2,
        "tie_word_embeddings": True,
        "block_size": 4,
        "text_config": {
            **_COMMON,
            "hidden_size": TARGET["hidden_size"] if echo else 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_kv_shared_layers": 0,  # all: the assistant keeps no KV
            "layer_types": [_SLIDING, _FULL],
            "use_double_wide_mlp": True,
            "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab,
            "tie_word_embeddings": True,
            **text,
        },
    }


def _seeded(name: str) -> np.random.Generator:
    return np.random.default_rng(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))


def build_tiny_gemma4(out_dir: Path, *, echo: bool = False) -> Path:
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4_text

    out_dir.mkdir(parents=True, exist_ok=True)
    config = target_config()
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    weights = _random_weights(dict(tree_flatten(model.parameters())), _seeded(f"gemma4:{echo}"))
    weights["lm_head.weight"][config["eos_token_id"]] *= 0.5  # rows run to max_tokens
    if echo:
        for name, w in weights.items():
            if name.endswith(_RESIDUAL):
                w[...] = 0.0
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer.json").write_text(_tokenizer_json_with(()))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2))
    return out_dir


def build_tiny_assistant(
    out_dir: Path, target_dir: Path, *, echo: bool = False, ordered: bool = False, **text: Any
) -> Path:
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4_text

    from mlxd.engine.chat.speculative.assistant_model import Gemma4Assistant

    out_dir.mkdir(parents=True, exist_ok=True)
    config = assistant_config(echo=echo, ordered=ordered, **text)
    n = config["text_config"]["num_hidden_layers"]
    args = gemma4_text.ModelArgs.from_dict({**config["text_config"], "num_kv_shared_layers": n})
    centroids = (config["num_centroids"], config["centroid_intermediate_top_k"])
    module = Gemma4Assistant(
        args, config["backbone_hidden_size"], tied=True, centroids=centroids if ordered else None
    )
    params = dict(tree_flatten(module.parameters()))
    rng = _seeded(f"gemma4-assistant:{echo}:{ordered}:{sorted(text.items())}")
    weights = _random_weights(params, rng)
    if ordered:  # each cluster's tokens, as the checkpoint stores them (int64)
        weights["masked_embedding.token_ordering"] = rng.permutation(args.vocab_size)
    if echo:
        size = TARGET["hidden_size"]
        weights["pre_projection.weight"] = np.concatenate(
            [np.eye(size), np.zeros((size, size))], axis=1
        ).astype(np.float32)
        for name, w in weights.items():
            if name.endswith(_RESIDUAL):
                w[...] = 0.0
        target = mx.load(str(target_dir / "model.safetensors"))
        assert isinstance(target, dict)
        weights["model.embed_tokens.weight"] = np.array(target["lm_head.weight"])
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def _key(*parts: Any) -> str:
    blob = json.dumps([_BUILD, TARGET, _content_key("llama"), *parts], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_gemma4_dir(*, echo: bool = False) -> Path:
    """A cached build of the target (see :func:`tests.support.tinymodels.tiny_model_dir`)."""
    name = f"gemma4_text-{'echo' if echo else 'random'}-{_key(echo)}"
    final = cache_root() / CONTENT_VERSION / name
    return build_once(final, lambda tmp: build_tiny_gemma4(tmp, echo=echo))


def tiny_assistant_dir(*, echo: bool = False, ordered: bool = False, **text: Any) -> Path:
    """A cached build of the assistant for :func:`tiny_gemma4_dir` (same ``echo``)."""
    target = tiny_gemma4_dir(echo=echo)
    config = assistant_config(echo=echo, ordered=ordered, **text)
    name = f"gemma4_assistant-{'echo' if echo else 'random'}-{_key(config, target.name)}"
    final = cache_root() / CONTENT_VERSION / name
    return build_once(
        final, lambda tmp: build_tiny_assistant(tmp, target, echo=echo, ordered=ordered, **text)
    )
