"""A tiny random-weight BERT embedding model, for real-MLX tests of ``/v1/embeddings``.

Built locally with ``mlx-embeddings``' own BERT class and saved as an ordinary embedding
model directory (``config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json``) that ``mlx_embeddings.utils.load(path)`` loads. Nothing is
downloaded: the WordPiece tokenizer (lower-casing, ``[CLS] ... [SEP]`` around every text,
like real BERT checkpoints) is trained on the chat models' corpus with ``tokenizers``.

:func:`tiny_encoder_dir` builds other encoder families of mlx-embeddings with the same
tokenizer: ``xlm_roberta`` (positions counted from the padding id) and ``modernbert``
(alternating local and global attention), as an embedding model and as a masked LM, and
``gemma3_text`` (EmbeddingGemma's architecture, sliding windows on two of three layers).

Another family, ``qwen3`` (:func:`tiny_qwen3_embedding_dir`), is a tiny random
Qwen3-Embedding: causal attention, last-token pooling, the chat models' byte-level BPE
tokenizer with ``<|endoftext|>`` appended to every text (as Qwen3-Embedding's does).

The BERT config declares ``matryoshka_dimensions``, mlxd's marker for a model trained for
truncated vectors (``dimensions`` in a request); tests that need a model without it copy
the directory and drop the key.

Use :func:`tiny_embedding_dir` for a cached build (one per content key, built atomically,
like :func:`tinymodels.tiny_model_dir`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.tinymodels import _CORPUS, _tokenizer_json_with, build_once, cache_root

__all__ = [
    "EMBED_CONFIG",
    "ENCODER_FAMILIES",
    "MINILM_SHAPE",
    "QWEN3_CONFIG",
    "build_tiny_embedding",
    "tiny_embedding_dir",
    "tiny_encoder_dir",
    "tiny_qwen3_embedding_dir",
]

CONTENT_VERSION = "e1"
VOCAB_SIZE = 400
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

EMBED_CONFIG: dict[str, Any] = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "pad_token_id": 0,
    "matryoshka_dimensions": [64, 32, 16],
}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), show_progress=False
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok.to_str()


def _vocab_size() -> int:
    return len(json.loads(_tokenizer_json())["model"]["vocab"])


def _tokenizer_config(max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        "do_lower_case": True,
        "clean_up_tokenization_spaces": False,
    }


# The shape of all-MiniLM-L6-v2 (a common real embedding model), for benchmarks.
MINILM_SHAPE: dict[str, Any] = {
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
}


def build_tiny_embedding(
    out_dir: Path, *, seed: int = 0, shape: dict[str, Any] | None = None
) -> Path:
    """Write the random-weight BERT into ``out_dir`` (deterministic for ``seed``).

    ``shape`` overrides config keys (e.g. :data:`MINILM_SHAPE` for a real model's size).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**EMBED_CONFIG, **(shape or {}), "vocab_size": _vocab_size()}
    config["torch_dtype"] = "float32"
    model = bert.Model(bert.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    digest = hashlib.sha256(f"bert:{seed}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    arrays = {}
    for name in sorted(params):
        shape = tuple(params[name].shape)
        leaf = name.rsplit(".", 1)[-1]
        if "embeddings" in name and len(shape) == 2:
            w = rng.normal(0.0, 0.5, shape)  # spread out, so different texts differ clearly
        elif len(shape) >= 2:
            w = rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)
        elif leaf == "bias":
            w = np.zeros(shape)
        else:
            w = np.array(params[name].astype(mx.float32))
        arrays[name] = mx.array(w.astype(np.float32))
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer.json").write_text(_tokenizer_json())
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(config["max_position_embeddings"]), indent=2)
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({t.strip("[]").lower() + "_token": t for t in SPECIAL}, indent=2)
    )
    return out_dir


def _content_key(extra: dict[str, Any], seed: int) -> str:
    import mlx.core as mx
    import mlx_embeddings

    blob = json.dumps(
        {
            "version": CONTENT_VERSION,
            **extra,
            "corpus": _CORPUS,
            "vocab": VOCAB_SIZE,
            "seed": seed,
            "mlx": mx.__version__,
            "mlx_embeddings": mlx_embeddings.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _cached(
    name: str, extra: dict[str, Any], seed: int, cache_dir: Path | None, build: Any
) -> Path:
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / CONTENT_VERSION
    return build_once(root / f"{name}-{_content_key(extra, seed)}", build)


def tiny_embedding_dir(*, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """A cached build under ``<cache_root()>/<CONTENT_VERSION>/bert-embed-<seed>-<key>``."""
    return _cached(
        f"bert-embed-{seed}", {"config": EMBED_CONFIG}, seed, cache_dir,
        lambda tmp: build_tiny_embedding(tmp, seed=seed),
    )  # fmt: skip


QWEN3_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_QWEN3_EOS = "<|endoftext|>"


def _qwen3_tokenizer_json() -> str:
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(_tokenizer_json_with(()))
    eos = tok.token_to_id(_QWEN3_EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {_QWEN3_EOS}", pair=f"$A {_QWEN3_EOS} $B:1 {_QWEN3_EOS}:1",
        special_tokens=[(_QWEN3_EOS, eos)],
    )  # fmt: skip
    return tok.to_str()


def build_tiny_qwen3_embedding(out_dir: Path, *, seed: int = 0) -> Path:
    """Write the random-weight Qwen3 embedding model into ``out_dir``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import qwen3

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _qwen3_tokenizer_json()
    vocab = len(json.loads(tokenizer)["model"]["vocab"])
    config = {**QWEN3_CONFIG, "vocab_size": vocab, "torch_dtype": "float32"}
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    digest = hashlib.sha256(f"qwen3:{seed}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    arrays = {}
    for name in sorted(params):
        shape = tuple(params[name].shape)
        if "embed" in name:
            w = rng.normal(0.0, 0.5, shape)
        elif len(shape) >= 2:
            w = rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)
        else:
            w = np.array(params[name].astype(mx.float32))
        arrays[name] = mx.array(w.astype(np.float32))
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer.json").write_text(tokenizer)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": QWEN3_CONFIG["max_position_embeddings"],
        "eos_token": _QWEN3_EOS,
        "pad_token": _QWEN3_EOS,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return out_dir


def tiny_qwen3_embedding_dir(*, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """A cached build of the tiny Qwen3 embedding model (see :func:`tiny_embedding_dir`)."""
    return _cached(
        f"qwen3-embed-{seed}", {"config": QWEN3_CONFIG, "eos": _QWEN3_EOS}, seed, cache_dir,
        lambda tmp: build_tiny_qwen3_embedding(tmp, seed=seed),
    )  # fmt: skip


# Other encoder families, with the BERT's WordPiece tokenizer ([PAD] = 0).
ENCODER_FAMILIES: dict[str, dict[str, Any]] = {
    "xlm_roberta": {
        "model_type": "xlm_roberta",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        # RoBERTa counts positions from pad_token_id + 1: 128 tokens.
        "max_position_embeddings": 130,
        "pad_token_id": 0,
        "type_vocab_size": 1,
    },
    "modernbert": {
        "model_type": "modernbert",
        "architectures": ["ModernBertModel"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        "local_attention": 8,
        "global_attn_every_n_layers": 3,
    },
}
# EmbeddingGemma's shape in small: gemma3 layers (sliding window 16 on two of three) with
# bidirectional attention, mean pooling and two dense layers.
ENCODER_FAMILIES["gemma3_text"] = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 16,
    "sliding_window": 16,
    "sliding_window_pattern": 3,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
}
# A ModernBERT checkpoint configured as a masked LM: per-token outputs, pooled by mlxd.
ENCODER_FAMILIES["modernbert_mlm"] = {
    **ENCODER_FAMILIES["modernbert"],
    "architectures": ["ModernBertForMaskedLM"],
}


def build_tiny_encoder(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write a random-weight ``family`` encoder (see :data:`ENCODER_FAMILIES`) into ``out_dir``."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    out_dir = Path(out_dir)
    build_tiny_embedding(out_dir, seed=seed)  # the tokenizer files (and BERT weights, replaced)
    config = {**ENCODER_FAMILIES[family], "vocab_size": _vocab_size(), "torch_dtype": "float32"}
    module = importlib.import_module(f"mlx_embeddings.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    digest = hashlib.sha256(f"{family}:{seed}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    arrays = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        shape = tuple(param.shape)
        if len(shape) >= 2:
            w = rng.normal(0.0, 0.5 if "embed" in name else 1.0 / np.sqrt(shape[-1]), shape)
        elif name.endswith("bias"):
            w = np.zeros(shape)
        else:
            w = np.array(param.astype(mx.float32))
        arrays[name] = mx.array(w.astype(np.float32))
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def tiny_encoder_dir(family: str, *, seed: int = 0, cache_dir: Path | None = None) -> Path:
    """A cached build of ``family`` (see :data:`ENCODER_FAMILIES`)."""
    return _cached(
        f"{family}-embed-{seed}", {"config": ENCODER_FAMILIES[family]}, seed, cache_dir,
        lambda tmp: build_tiny_encoder(family, tmp, seed=seed),
    )  # fmt: skip


def chat_and_embedding_registry(tiny_models: Any, embedding: Path) -> dict[str, Any]:
    """A ``[models]`` registry: the tiny llama (default) and the embedding model ``embedding``."""
    return {
        "chat": {"path": str(tiny_models("llama")), "default": True},
        "emb": {
            "path": str(embedding),
            "kind": "embedding",
            "aliases": ["text-embedding-3-small"],
            "batch": {"size": 4},
        },
    }
