"""Tiny random-weight rerankers for ``kind = "rerank"`` (issue 37), built offline.

- :func:`build_cross_encoder`: the tiny BERT of :mod:`tests.support.tinyembed` saved as
  Hugging Face's ``BertForSequenceClassification`` checkpoint: weights under ``bert.``,
  one-label ``classifier.weight``/``bias`` (what the ms-marco MiniLM cross-encoders ship).
- :func:`build_yes_no_lm`: a tiny chat model of :mod:`tests.support.tinymodels` (a causal
  LM, random weights) that names its architecture (``LlamaForCausalLM``), as
  Qwen3-Reranker's ``Qwen3ForCausalLM`` does: its p(yes) is noise, checked against the
  same number computed in the test with mlx-lm.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np


def build_cross_encoder(embedding_dir: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """Copy ``embedding_dir`` (a tiny BERT) to ``out_dir`` as a sequence classifier."""
    import mlx.core as mx

    shutil.copytree(embedding_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    config.pop("matryoshka_dimensions", None)
    (out_dir / "config.json").write_text(json.dumps(config))
    from mlxd.engine.rerank.loading import load_tensors

    weights = {f"bert.{k}": v for k, v in load_tensors(out_dir).items()}
    rng = np.random.default_rng(seed)
    hidden = int(config["hidden_size"])
    weights["classifier.weight"] = mx.array(rng.normal(0, 1, (1, hidden)).astype(np.float32))
    weights["classifier.bias"] = mx.zeros((1,))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    return out_dir


def build_yes_no_lm(model_dir: Path, out_dir: Path) -> Path:
    """Copy the tiny causal LM ``model_dir`` to ``out_dir``; it names its architecture."""
    shutil.copytree(model_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
