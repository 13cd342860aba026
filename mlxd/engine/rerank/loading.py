"""Loading a reranker (``kind = "rerank"``) and scoring (query, document) pairs.

Two kinds of model, told apart by ``config.json``:

- **Cross-encoders** (``architectures`` ending in ``ForSequenceClassification``:
  the ms-marco MiniLM and bge-reranker families): a BERT or XLM-RoBERTa encoder
  from mlx-embeddings (which has no classifier head) under mlxd's own head,
  loaded from the checkpoint's ``classifier.*`` weights: BERT's linear layer
  over the pooled ``[CLS]`` vector, or RoBERTa's dense-tanh-out_proj over
  ``<s>``. The pair is encoded as ``[CLS] query [SEP] document [SEP]``
  (segment ids from the first ``[SEP]``); the score is ``sigmoid(logit)`` for
  one label, else the softmax probability of the last label.
- **Yes/no LM rerankers** (``ForCausalLM``: Qwen3-Reranker): an mlx-lm model
  reads Qwen3-Reranker's judge prompt with the query and the document; the
  score is ``p(yes) / (p(yes) + p(no))`` at the last position.

Runs on the engine's thread (MLX state). A pair crosses the embedding engine's
queue as one text, ``query + PAIR_SEP + document``; the encoder splits it.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.config import ModelSettings
from mlxd.engine.chat.loading import ModelLoadError, describe_dtype
from mlxd.engine.embeddings.loading import (
    LoadedEmbedding,
    _context_length,
    _hf,
    check_model_dir,
)
from mlxd.engine.embeddings.messages import EmbeddingInfo
from mlxd.engine.rerank.pairs import PAIR_SEP, split_pair
from mlxd.engine.weights import nbytes

logger = logging.getLogger(__name__)


CROSS_ENCODER = "cross_encoder"
YES_NO_LM = "yes_no_lm"

# Qwen3-Reranker's judge prompt (its model card), the instruction its default.
JUDGE_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
JUDGE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

_ENCODERS = ("bert", "xlm_roberta")


def scoring_of(config: dict[str, Any]) -> str:
    """``cross_encoder`` or ``yes_no_lm`` from ``config.json``; ModelLoadError otherwise."""
    architectures = config.get("architectures") or []
    names = " ".join(a for a in architectures if isinstance(a, str))
    if "ForSequenceClassification" in names:
        if config["model_type"] not in _ENCODERS:
            raise ModelLoadError(
                f"cross-encoder rerankers of model_type {config['model_type']!r} are not "
                f"supported (supported: {', '.join(_ENCODERS)})"
            )
        return CROSS_ENCODER
    if "ForCausalLM" in names or "ForConditionalGeneration" in names:
        return YES_NO_LM
    raise ModelLoadError(
        f"config.json's architectures {architectures!r} name neither a sequence classifier "
        "(a cross-encoder) nor a causal LM (a yes/no reranker such as Qwen3-Reranker)"
    )


def load_reranker(settings: ModelSettings, model_id: str) -> LoadedEmbedding:
    """Load the configured reranker; its ``forward`` gives one score per pair.

    Raises:
        ModelLoadError: the path, the architecture, a missing package or head.
    """
    started = time.perf_counter()
    path, config = check_model_dir(settings)
    scoring = scoring_of(config)
    if scoring == CROSS_ENCODER:
        model, hf, forward, pad = _cross_encoder(path, config)
        context = _context_length(config, hf, settings.max_context)
    else:
        model, hf, forward, pad = _yes_no_lm(path)
        context = settings.max_context or int(config.get("max_position_embeddings") or 4096)
    encode = _pair_encoder(hf, scoring)
    weights = nbytes(model)
    info = EmbeddingInfo(
        id=model_id,
        path=str(path),
        family=str(config["model_type"]),
        dimensions=1,
        context_length=context,
        vocab_size=int(config.get("vocab_size") or len(hf)),
        weights_bytes=weights,
        supports_dimensions=False,
        dtype=describe_dtype(model, config),
        created=int(time.time()),
        scoring=scoring,
    )
    forward(encode(["mlxd" + PAIR_SEP + "probe"]))  # fails here, not on a request
    logger.info(
        "loaded reranker %s (%s, %s, %s) in %.1fs",
        model_id,
        scoring,
        config["model_type"],
        path,
        time.perf_counter() - started,
    )
    return LoadedEmbedding(model=model, encode=encode, info=info, pad_id=pad, forward=forward)


def _pair_encoder(hf: Any, scoring: str) -> Callable[[list[str]], list[list[int]]]:
    """Pairs (joined by PAIR_SEP) to token ids: the tokenizer's pair encoding, or the
    judge prompt. Called from intake threads, one call at a time per tokenizer."""
    import threading

    lock = threading.Lock()

    def encode(texts: list[str]) -> list[list[int]]:
        pairs = [split_pair(t) for t in texts]
        with lock:
            if scoring == CROSS_ENCODER:
                out = hf([q for q, _ in pairs], [d for _, d in pairs], add_special_tokens=True)
                return [list(ids) for ids in out["input_ids"]]
            prompts = [
                f"{JUDGE_PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {q}\n<Document>: {d}"
                f"{JUDGE_SUFFIX}"
                for q, d in pairs
            ]
            return [list(hf.encode(p, add_special_tokens=False)) for p in prompts]

    return encode


def _padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def _cross_encoder(path: Path, config: dict[str, Any]) -> tuple[Any, Any, Any, int]:
    try:
        family = importlib.import_module(f"mlx_embeddings.models.{config['model_type']}")
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(
            f"cross-encoder rerankers need mlx-embeddings ({exc}): run "
            "`pip install 'mlxd[embeddings]'` and restart mlxd"
        ) from exc
    encoder = family.Model(family.ModelArgs.from_dict(config))
    weights = load_tensors(path)
    head = {k.removeprefix("classifier."): v for k, v in weights.items() if "classifier." in k}
    body = {
        k.split(".", 1)[1] if k.startswith(("bert.", "roberta.")) else k: v
        for k, v in weights.items()
        if "classifier." not in k and "position_ids" not in k
    }
    try:
        encoder.load_weights(list(body.items()))
    except ValueError as exc:
        raise ModelLoadError(f"the encoder's weights do not fit its config: {exc}") from exc
    encoder.eval()  # dropout off
    mx.eval(encoder.parameters())
    classify = _head(head, config)
    sep = int(config.get("sep_token_id") or 0)
    hf = AutoTokenizer.from_pretrained(str(path))
    sep = hf.sep_token_id if isinstance(hf.sep_token_id, int) else sep
    pad = int(hf.pad_token_id if isinstance(hf.pad_token_id, int) else 0)
    segments = int(config.get("type_vocab_size") or 1) > 1
    pooled = "dense.weight" not in head  # BERT's head reads the pooler's output

    def forward(rows: Sequence[Sequence[int]]) -> np.ndarray:
        ids, mask = _padded(rows, pad)
        types = np.zeros_like(ids)
        if segments:  # segment 1 from after the first [SEP] on
            types = (np.cumsum(ids == sep, axis=1) - (ids == sep)).clip(0, 1).astype(np.int32)
        out = encoder(mx.array(ids), token_type_ids=mx.array(types), attention_mask=mx.array(mask))
        x = out.pooler_output if pooled else out.last_hidden_state[:, 0]
        logits = classify(x).astype(mx.float32)
        if logits.shape[-1] == 1:
            scores = mx.sigmoid(logits[:, 0])
        else:
            scores = mx.softmax(logits, axis=-1)[:, -1]
        return np.array(scores, dtype=np.float32)[:, None]

    return encoder, hf, forward, pad


def load_tensors(path: Path) -> dict[str, mx.array]:
    """Every tensor of the directory's ``*.safetensors`` files, by name."""
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        loaded = mx.load(str(file))
        if isinstance(loaded, dict):
            weights.update(cast("dict[str, mx.array]", loaded))
    return weights


def _linear(weight: mx.array, bias: mx.array) -> nn.Linear:
    out_dims, in_dims = weight.shape
    linear = nn.Linear(in_dims, out_dims)
    linear.load_weights([("weight", weight), ("bias", bias)])
    return linear


def _head(head: dict[str, mx.array], config: dict[str, Any]) -> Callable[[mx.array], mx.array]:
    """The classifier: BERT's ``classifier`` linear, or RoBERTa's dense + out_proj."""
    if "weight" in head and "bias" in head:
        return _linear(head["weight"], head["bias"])
    if {"dense.weight", "dense.bias", "out_proj.weight", "out_proj.bias"} <= head.keys():
        dense = _linear(head["dense.weight"], head["dense.bias"])
        out = _linear(head["out_proj.weight"], head["out_proj.bias"])
        return lambda x: out(mx.tanh(dense(x)))
    raise ModelLoadError(
        f"no classifier head in the weights (classifier.weight or classifier.dense/out_proj) "
        f"of this {config['model_type']} sequence classifier"
    )


def _yes_no_lm(path: Path) -> tuple[Any, Any, Any, int]:
    from mlx_lm import load

    try:
        loaded = load(str(path))
    except Exception as exc:
        raise ModelLoadError(f"mlx_lm.load({str(path)!r}) failed: {exc}") from exc
    model, hf = loaded[0], _hf(loaded[1])
    yes, no = _answer_id(hf, "yes"), _answer_id(hf, "no")
    if yes == no:
        raise ModelLoadError("the tokenizer reads 'yes' and 'no' as the same token")
    pad = int(hf.pad_token_id if isinstance(hf.pad_token_id, int) else 0)

    def forward(rows: Sequence[Sequence[int]]) -> np.ndarray:
        ids, mask = _padded(rows, pad)
        logits = model(mx.array(ids))  # causal: right padding cannot reach a real token
        last = mx.array(mask.sum(axis=1) - 1)
        at = logits[mx.arange(len(rows)), last]
        pair = mx.stack([at[:, no], at[:, yes]], axis=-1).astype(mx.float32)
        return np.array(mx.softmax(pair, axis=-1)[:, 1], dtype=np.float32)[:, None]

    return model, hf, forward, pad


def _answer_id(hf: Any, word: str) -> int:
    """The token of ``word`` (Qwen's vocabulary has "yes" and "no"), else its first token."""
    found = hf.convert_tokens_to_ids(word)
    if isinstance(found, int) and found != hf.unk_token_id:
        return found
    ids = hf.encode(word, add_special_tokens=False)
    if not ids:
        raise ModelLoadError(f"the tokenizer gives no token for {word!r}")
    return int(ids[0])
