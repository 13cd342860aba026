"""Loading an embedding model with ``mlx-embeddings`` and running one forward pass.

Everything here runs on the embedding engine's thread: it creates MLX state.
``mlx-embeddings`` is an optional extra (``pip install 'mlxd[embeddings]'``),
imported only when a model loads, so a chat-only install never needs it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.config import ModelSettings
from mlxd.engine.chat.loading import ModelLoadError, describe_dtype, max_token_chars
from mlxd.engine.embeddings.jobs import normalize
from mlxd.engine.embeddings.messages import EmbeddingInfo
from mlxd.engine.weights import nbytes
from mlxd.modelcheck import embeddings_install_hint

logger = logging.getLogger(__name__)


# Families trained with Matryoshka representation learning: their vectors may be
# truncated (then renormalized) to fewer dimensions. Any other model opts in by
# listing "matryoshka_dimensions" in its config.json.
MATRYOSHKA_FAMILIES = frozenset({"qwen3", "gemma3_text"})


@dataclass
class LoadedEmbedding:
    """An embedding model and its tokenizer, owned by the engine thread."""

    model: Any
    # Texts to token ids; holds no MLX state, so intake threads may call it.
    encode: Callable[[list[str]], list[list[int]]]
    info: EmbeddingInfo
    pad_id: int
    # Rows of token ids to one row of floats each, in place of run_pass (a reranker's).
    forward: Callable[[Sequence[Sequence[int]]], np.ndarray] | None = None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path / 'config.json')!r}: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{str(path / 'config.json')!r} names no model_type")
    return config


def check_model_dir(settings: ModelSettings) -> tuple[Path, dict[str, Any]]:
    """The configured directory and its config.json, checked before anything loads.

    ``mlx_embeddings.load`` downloads from the Hugging Face hub when a path does
    not exist: mlxd never lets it, a missing directory is a load error.
    """
    if settings.repo:
        from mlxd.hub import NotPulled, local_snapshot

        try:
            path = local_snapshot(settings.repo, settings.repo_revision)
        except NotPulled as exc:
            raise ModelLoadError(str(exc)) from None
        return path, _read_config(path)
    if not settings.path:  # the built-in demo embedding model (mlxd.demo.embedding)
        from mlxd.demo import DemoModelUnavailable
        from mlxd.demo.embedding import prepare_demo_embedding

        try:
            path = prepare_demo_embedding()
        except DemoModelUnavailable as exc:
            raise ModelLoadError(str(exc)) from exc
        return path, _read_config(path)
    path = Path(settings.path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model path {str(path)!r} is not a directory. mlxd loads local embedding "
            "model directories only (it never downloads)."
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; is it a model directory?")
    config = _read_config(path)
    if "vision_config" in config:
        raise ModelLoadError(
            f"{str(path)!r} is a vision embedding model ({config['model_type']}); "
            "mlxd serves text embedding models only"
        )
    return path, config


def _import_mlx_embeddings() -> Any:
    try:
        from mlx_embeddings import utils
    except ImportError as exc:
        raise ModelLoadError(
            "embedding models need the optional mlx-embeddings package, which cannot be "
            f"imported ({exc}): install it with {embeddings_install_hint()}, "
            "then restart mlxd"
        ) from exc
    return utils


def _context_length(config: dict[str, Any], tokenizer: Any, configured: int | None) -> int:
    declared = int(config.get("max_position_embeddings") or 512)
    if config["model_type"] in ("xlm_roberta", "roberta"):
        # Positions start after the padding index (RoBERTa's offset): 514 -> 512.
        declared -= int(config.get("pad_token_id", 1)) + 1
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < declared:
        declared = limit
    return min(configured, declared) if configured else declared


def _hf(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-embeddings' wrapper."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _is_text_tokenizer(hf: Any) -> bool:
    """A Hugging Face text tokenizer (a vision model's processor has no vocabulary)."""
    return callable(hf) and hasattr(hf, "get_vocab")


def size_bounds(hf: Any) -> tuple[int, bool]:
    """What bounds a text's tokens from below, before tokenizing: ``(chars, words)``.

    ``chars``: the most characters one token can stand for (the longest
    vocabulary entry, :func:`max_token_chars`), or 0 where one token can
    stand for a run of any length: BPE with ``fuse_unk`` and Unigram
    (SentencePiece) fuse a run of unknown characters into one token, and
    WordPiece maps any word longer than ``max_input_chars_per_word`` to one
    ``[UNK]``. ``words``: every whitespace-separated word gives at least one
    token (WordPiece, which splits on whitespace before anything else).
    """
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return 0, False
    try:
        model = json.loads(backend.to_str()).get("model", {})
    except Exception:  # a tokenizer that cannot describe itself: no bound
        return 0, False
    kind = model.get("type")
    if kind == "WordPiece":
        return 0, True
    if kind == "BPE" and not (model.get("fuse_unk") and model.get("unk_token")):
        return max_token_chars(hf), False
    return 0, False


def make_encoder(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    """A function from texts to token ids with the model's special tokens (``[CLS] ... [SEP]``).

    With a fast tokenizer it calls the Rust tokenizer directly, on a private
    copy with truncation and padding off (a ``tokenizer.json`` may switch
    them on; an input too long must be refused, never cut): that call holds
    no Python state, releases the GIL, and is safe from several intake
    threads at once. Other tokenizers go through the Hugging Face wrapper,
    one call at a time.
    """
    hf = _hf(tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        own = Tokenizer.from_str(backend.to_str())
        own.no_truncation()
        own.no_padding()

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in own.encode_batch(texts, add_special_tokens=True)]

        return encode
    lock = threading.Lock()

    def encode_slow(texts: list[str]) -> list[list[int]]:
        with lock:
            encoded = hf(list(texts), add_special_tokens=True, verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]

    return encode_slow


def load_embedding(settings: ModelSettings, model_id: str) -> LoadedEmbedding:
    """Load the configured embedding model and probe its output width.

    Raises:
        ModelLoadError: with a message meant for the operator (the extra is not
            installed, the path is wrong, the family is unknown to mlx-embeddings).
    """
    started = time.perf_counter()
    path, config = check_model_dir(settings)
    utils = _import_mlx_embeddings()  # seconds on the first load: transformers, mlx-vlm
    family = config["model_type"].replace("-", "_")
    if importlib.util.find_spec(f"mlx_embeddings.models.{family}") is None:
        raise ModelLoadError(
            f"mlx-embeddings does not support model_type {config['model_type']!r} ({str(path)!r})"
        )
    try:
        model, tokenizer = utils.load(str(path))
    except Exception as exc:
        raise ModelLoadError(f"mlx_embeddings.load({str(path)!r}) failed: {exc}") from exc
    hf = _hf(tokenizer)
    if not _is_text_tokenizer(hf):
        raise ModelLoadError(f"{str(path)!r} has a processor, not a text tokenizer")
    vocab = len(hf)
    if config.get("vocab_size"):
        vocab = min(vocab, int(config["vocab_size"]))
    pad = config.get("pad_token_id")
    if not isinstance(pad, int):
        pad = hf.pad_token_id if isinstance(hf.pad_token_id, int) else 0
    if not 0 <= pad < vocab:
        pad = 0  # padding is masked out; it only has to index the embedding table
    chars, words = size_bounds(hf)
    encode = make_encoder(tokenizer)
    probe = encode(["mlxd"])[0]
    dims = int(run_pass(model, [probe], pad).shape[-1])
    weights = nbytes(model)
    info = EmbeddingInfo(
        id=model_id,
        path=str(path),
        family=family,
        dimensions=dims,
        context_length=_context_length(config, hf, settings.max_context),
        vocab_size=vocab,
        weights_bytes=weights,
        supports_dimensions=family in MATRYOSHKA_FAMILIES
        or bool(config.get("matryoshka_dimensions")),
        dtype=describe_dtype(model, config),
        max_token_chars=chars,
        min_token_per_word=words,
        created=int(time.time()),
    )
    logger.info(
        "loaded embedding model %s (%s, %s) in %.1fs: %d dimensions, %d tokens per input, "
        "%d MiB of weights",
        model_id,
        family,
        path,
        time.perf_counter() - started,
        dims,
        info.context_length,
        weights // 2**20,
    )
    return LoadedEmbedding(model=model, encode=encode, info=info, pad_id=int(pad))


def run_pass(model: Any, rows: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
    """One forward pass over ``rows`` (right-padded, masked): unit float32 vectors.

    Padding positions are masked out of attention and pooling, so a row's
    vector does not depend on what else shares its pass.
    """
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    attention = mx.array(mask)
    out = model(mx.array(ids), attention_mask=attention)
    pooled = out.text_embeds
    if pooled is None:
        pooled = out.pooler_output
    elif pooled.ndim == 3:
        # Per-token vectors (LFM2; a ModernBERT configured as a masked LM): their mean
        # over the real tokens, as LFM2's own pooler does.
        weights = attention[:, :, None].astype(pooled.dtype)
        pooled = (pooled * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1)
    if pooled is None or pooled.ndim != 2 or pooled.shape[0] != len(rows):
        shape = None if pooled is None else tuple(pooled.shape)
        raise ValueError(f"the model gave no pooled vectors for {len(rows)} inputs: {shape}")
    vectors = np.array(pooled.astype(mx.float32), dtype=np.float32)
    return normalize(vectors)


def release_cache() -> None:
    """Hand MLX's cached buffers (a pass's activations, freed weights) back to the system."""
    mx.clear_cache()
