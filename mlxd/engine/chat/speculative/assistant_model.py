"""Gemma 4's assistant: a small checkpoint drafting from its target's hidden state and KV.

A Gemma 4 "assistant" (``model_type = "gemma4_assistant"``, a directory of its
own next to its target's) keeps no KV cache: each of its decoder layers
(mlx-lm's ``gemma4_text`` layers, all KV-shared, so without key and value
projections) attends over the target's own keys and values, those of the
target's last full-attention and last sliding-window layer that keep a cache.
It reads the target's hidden state after its final norm and the target's
token embedding::

    h = pre_projection([embed(x_{t+1}) * sqrt(hidden), h_t])   # the target's embedding
    h = norm(layers(h, the target's KV of positions <= t, at position t + 1))
    x_{t+2} = argmax(embed_tokens.as_linear(h))   # its own (smaller) tied head
    h_{t+1} = post_projection(h)                  # the next draft step's h_t

Deeper drafts feed its own token and ``post_projection`` output back, at the
same position (as Hugging Face's and mlx-vlm's drafters do). mlx-vlm 0.7.10
ships the reference (``mlx_vlm.speculative.drafters.gemma4_assistant``); this
port uses mlx-lm's layers so a text model needs no mlx-vlm, and a test holds
its drafts equal to mlx-vlm's. The E2B/E4B assistants' centroid-routed head
(``use_ordered_embeddings``) scores only the tokens of its best clusters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from mlxd.engine.chat.loading import LoadedModel, ModelLoadError
from mlxd.engine.weights import nbytes

MODEL_TYPE = "gemma4_assistant"
_TYPES = ("full_attention", "sliding_attention")


def is_assistant(path: str) -> bool:
    """Whether ``path`` holds a Gemma 4 assistant (its ``config.json`` says so)."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


class _Inner(nn.Module):
    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class _Centroids(nn.Module):
    """The E2B/E4B assistants' centroid-routed head, greedy: the best token among those of
    the ``top_k`` best-scoring clusters (``token_ordering`` lists each cluster's tokens)."""

    def __init__(self, hidden: int, vocab: int, clusters: int, top_k: int):
        super().__init__()
        self.centroids = nn.Linear(hidden, clusters, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.clusters, self.top_k = clusters, top_k

    def choose(self, h: mx.array, embed: nn.Module) -> mx.array:
        top = mx.argpartition(self.centroids(h), kth=-self.top_k, axis=-1)[..., -self.top_k :]
        ordering = self.token_ordering.reshape(self.clusters, -1)
        chosen = ordering[top].reshape(*h.shape[:2], -1)  # B, L, top_k x tokens per cluster
        scores = (h[..., None, :] @ embed(chosen).swapaxes(-1, -2)).squeeze(-2)
        best = mx.argmax(scores, axis=-1)[..., None]
        return mx.take_along_axis(chosen, best, axis=-1).squeeze(-1)


class Gemma4Assistant(nn.Module):
    """The assistant's module, in its checkpoint's layout (``model.*``, the projections)."""

    def __init__(
        self,
        args: gemma4_text.ModelArgs,
        backbone: int,
        tied: bool,
        centroids: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.model = _Inner(args)
        self.pre_projection = nn.Linear(2 * backbone, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, backbone, bias=False)
        if not tied:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if centroids is not None:
            self.masked_embedding = _Centroids(args.hidden_size, args.vocab_size, *centroids)

    def __call__(
        self, embeds: mx.array, hidden: mx.array, kv: dict[str, tuple[mx.array, mx.array]], at: int
    ) -> tuple[mx.array, mx.array]:
        """(what the head reads, the next step's hidden) for ``embeds`` and ``hidden`` at
        position ``at``."""
        h = self.pre_projection(mx.concatenate([embeds, hidden], axis=-1))
        for layer in self.model.layers:
            h, _, _ = layer(
                h, None, None, per_layer_input=None, shared_kv=kv[layer.layer_type], offset=at
            )
        h = self.model.norm(h)
        return h, self.post_projection(h)

    def logits(self, h: mx.array) -> mx.array:
        """The full-vocabulary head (the tied embedding, or ``lm_head``)."""
        head = self.lm_head if "lm_head" in self else self.model.embed_tokens.as_linear
        return head(h)

    def choose(self, h: mx.array) -> mx.array:
        """The greedy token at each position of ``h`` (B x L)."""
        if "masked_embedding" in self:
            return self.masked_embedding.choose(h, self.model.embed_tokens)
        return mx.argmax(self.logits(h), axis=-1)


@dataclass
class AssistantModel:
    """A loaded assistant and the target parts it drafts with."""

    module: Gemma4Assistant
    path: str
    weights_bytes: int
    # The target's language model (mlx-lm's gemma4_text.Model).
    target: Any
    # Layer type -> the index of the target's layer cache the assistant's layers of that type read.
    layers: dict[str, int]
    # The sliding window: a sliding layer sees the last ``window - 1`` positions.
    window: int

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's input embedding of ``tokens``, scaled as the target scales it."""
        inner = self.target.model
        return inner.embed_tokens(tokens) * inner.embed_scale

    def forward(self, inputs: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """(the target's hidden states after its final norm, its logits): its own forward."""
        lm = self.target
        hidden = lm.model(inputs, cache=cache)
        logits = (
            lm.model.embed_tokens.as_linear(hidden)
            if lm.tie_word_embeddings
            else lm.lm_head(hidden)
        )
        if lm.final_logit_softcapping is not None:
            logits = gemma4_text.logit_softcap(lm.final_logit_softcapping, logits)
        return hidden, logits


def _refused(path: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"[speculative] draft_model {path!r} (a Gemma 4 assistant) {why}")


def load_assistant(path: str, loaded: LoadedModel) -> AssistantModel:
    """Load the assistant at ``path`` for ``loaded``; raises ``ModelLoadError`` naming it."""
    where = Path(path).expanduser()
    config = json.loads((where / "config.json").read_text())
    lm = getattr(loaded.model, "language_model", loaded.model)
    if loaded.vision is not None or not isinstance(lm, gemma4_text.Model):
        what = f"a {loaded.info.family!r} model"
        if loaded.vision is not None:
            what = "served through mlx-vlm"
        raise _refused(
            path, f"drafts for Gemma 4 text models (gemma4_text); {loaded.info.id!r} is {what}"
        )
    target: gemma4_text.ModelArgs = lm.args
    text = dict(config.get("text_config") or {})
    args = _check(path, config, text, target)
    owned = target.num_hidden_layers - target.num_kv_shared_layers
    kinds = list(target.layer_types or [])
    layers = {t: max(i for i in range(owned) if kinds[i] == t) for t in set(args.layer_types or [])}
    centroids = None
    if config.get("use_ordered_embeddings"):
        centroids = (int(config["num_centroids"]), int(config["centroid_intermediate_top_k"]))
    module = Gemma4Assistant(
        args, target.hidden_size, bool(config.get("tie_word_embeddings", True)), centroids
    )
    weights: dict[str, mx.array] = {}
    for file in sorted(where.glob("*.safetensors")):
        part = mx.load(str(file))
        assert isinstance(part, dict)
        weights.update(part)
    weights = {k: v for k, v in weights.items() if _kept(k, "lm_head" in module)}
    if "masked_embedding.token_ordering" in weights:  # int64 in the checkpoint
        ordering = weights["masked_embedding.token_ordering"]
        weights["masked_embedding.token_ordering"] = ordering.astype(mx.int32)
    quantization = config.get("quantization")
    try:
        if quantization:
            nn.quantize(
                module,
                group_size=quantization["group_size"],
                bits=quantization["bits"],
                mode=quantization.get("mode", "affine"),
                class_predicate=lambda p, _m: f"{p}.scales" in weights,
            )
        module.load_weights(list(weights.items()), strict=True)
    except (ValueError, KeyError) as exc:
        raise _refused(path, f"has weights this build cannot read: {exc}") from exc
    mx.eval(module.parameters())
    return AssistantModel(module, str(where), nbytes(module), lm, layers, target.sliding_window)


def _kept(key: str, untied: bool) -> bool:
    """Checkpoint keys the module has: KV-shared layers keep no key/value projections."""
    if key.startswith("lm_head.") and not untied:
        return False
    return not any(s in key for s in (".k_proj.", ".v_proj.", ".k_norm.", ".per_layer_"))


def _check(
    path: str, config: dict[str, Any], text: dict[str, Any], target: gemma4_text.ModelArgs
) -> gemma4_text.ModelArgs:
    """The assistant's layer arguments, once its config is known to fit ``target``."""
    if config.get("use_ordered_embeddings"):
        clusters, top = config.get("num_centroids"), config.get("centroid_intermediate_top_k")
        vocab = text.get("vocab_size")
        if not (
            isinstance(clusters, int)
            and isinstance(top, int)
            and isinstance(vocab, int)
            and 0 < top <= clusters
            and vocab % clusters == 0
        ):
            raise _refused(
                path,
                f"has a centroid-routed head this build cannot run ({clusters} clusters, "
                f"top {top}, vocabulary {vocab})",
            )
    backbone = config.get("backbone_hidden_size")
    if backbone != target.hidden_size:
        raise _refused(path, f"is for a target of hidden size {backbone}, not {target.hidden_size}")
    if text.get("vocab_size") != target.vocab_size:
        raise _refused(
            path, f"has a vocabulary of {text.get('vocab_size')}, its target {target.vocab_size}"
        )
    n = int(text.get("num_hidden_layers", 0))
    if text.get("num_kv_shared_layers") not in (None, 0, n):
        raise _refused(
            path, "has layers with their own KV (num_kv_shared_layers < num_hidden_layers)"
        )
    args = gemma4_text.ModelArgs.from_dict(
        {**text, "num_kv_shared_layers": n, "hidden_size_per_layer_input": 0}
    )
    kinds = list(args.layer_types or [])
    owned = set(
        list(target.layer_types or [])[: target.num_hidden_layers - target.num_kv_shared_layers]
    )
    for kind in set(kinds):
        if kind not in _TYPES or kind not in owned:
            raise _refused(path, f"has {kind!r} layers; its target keeps no such cache")
        full = kind == "full_attention"
        mine = args.global_head_dim if full and args.global_head_dim else args.head_dim
        theirs = target.global_head_dim if full and target.global_head_dim else target.head_dim
        heads = (
            target.num_global_key_value_heads
            if full and target.attention_k_eq_v and target.num_global_key_value_heads
            else target.num_key_value_heads
        )
        if mine != theirs or args.num_attention_heads % heads:
            raise _refused(
                path,
                f"attends with {args.num_attention_heads} heads of {mine} on {kind} layers; "
                f"its target keeps {heads} KV heads of {theirs}",
            )
    if "sliding_attention" in kinds and args.sliding_window != target.sliding_window:
        raise _refused(
            path,
            f"has a sliding window of {args.sliding_window}, its target {target.sliding_window}",
        )
    return args
