"""An MTP head: the multi-token-prediction layer a checkpoint carries, as an MLX module.

DeepSeek-V3/V3.1/R1 (``deepseek_v3``), DeepSeek-V3.2 (``deepseek_v32``, whose
layers keep a second cache for their sparse-attention indexer: a
``CacheList``), GLM-4.5 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``)
keep one such layer after their decoder
layers, as ``model.layers.<num_hidden_layers>.*`` (DeepSeek-V3's layout): given the
target's last hidden state ``h_t`` (after its final norm, what its output
head reads) and the embedding of the token after it, ``x_{t+1}``, it
predicts ``x_{t+2}``::

    h = eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])
    h = decoder_layer(h)             # attention over the MTP layer's own KV
    logits = lm_head(shared_head.norm(h))

The embedding and output head are the target's (the checkpoint's
``embed_tokens`` and ``shared_head.head`` copies of them are not loaded).
Drafting deeper than one token feeds ``h`` back in as the next ``h_t``.

Qwen3.5/3.6 (``qwen3_5``, ``qwen3_5_moe``) and Qwen3-Next keep theirs as
``mtp.*`` (:class:`QwenMtp`): ``fc`` over ``[pre_fc_norm_embedding(embed(x_{t+1})),
pre_fc_norm_hidden(h_t)]``, full-attention decoder layers, a final ``norm``
whose output both feeds the target's head and the next draft step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

# Families whose MTP layout this module reads (config model_type, which is also
# the mlx-lm module), with their decoder layer's class in that module.
NEXTN_FAMILIES: dict[str, str] = {
    "deepseek_v3": "DeepseekV3DecoderLayer",  # DeepSeek-V3, V3.1, R1 (MLA attention)
    "deepseek_v32": "DeepseekV32DecoderLayer",  # DeepSeek-V3.2 (MLA + sparse-attention indexer)
    "glm4_moe": "DecoderLayer",  # GLM-4.5, 4.6, 4.7
    "glm4_moe_lite": "Glm4MoeLiteDecoderLayer",  # GLM-4.7-Flash (MLA attention)
}


# Families with the Qwen3.5 ``mtp.*`` layout (config model_type): the mlx-lm
# module and class of their decoder layer.
QWEN_FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3_5": ("qwen3_5", "DecoderLayer"),  # Qwen3.5/3.6 dense
    "qwen3_5_moe": ("qwen3_5", "DecoderLayer"),  # Qwen3.5/3.6 MoE
    "qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer"),
}


class _SharedHead(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(size, eps=eps)


class NextN(nn.Module):
    """The ``model.layers.<N>`` MTP layer: projections, one decoder layer, a norm."""

    def __init__(self, block: nn.Module, size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(size, eps=eps)
        self.hnorm = nn.RMSNorm(size, eps=eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.block = block
        self.shared_head = _SharedHead(size, eps)

    def __call__(
        self, embeds: mx.array, hidden: mx.array, caches: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """(what the output head reads, the hidden state the next draft step takes)."""
        h = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        first = caches[0][0] if isinstance(caches[0], CacheList) else caches[0]
        mask = create_attention_mask(h, first, return_array=True)
        h = self.block(h, mask, caches[0])
        return self.shared_head.norm(h), h


class QwenMtp(nn.Module):
    """Qwen3.5's ``mtp.*``: ``fc`` over both normed inputs, decoder layers, a norm."""

    def __init__(self, args: Any, layers: int, family: str = "qwen3_5"):
        super().__init__()
        import importlib

        where, name = QWEN_FAMILIES[family]
        layer = getattr(importlib.import_module(f"mlx_lm.models.{where}"), name)
        size, eps = args.hidden_size, args.rms_norm_eps
        full = replace(args, full_attention_interval=1)  # every MTP layer attends
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=eps)
        self.layers = [layer(full, 0) for _ in range(layers)]
        self.norm = nn.RMSNorm(size, eps=eps)

    def __call__(
        self, embeds: mx.array, hidden: mx.array, caches: list[Any]
    ) -> tuple[mx.array, mx.array]:
        both = [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)]
        h = self.fc(mx.concatenate(both, axis=-1))
        mask = cast("mx.array | None", create_attention_mask(h, caches[0], return_array=True))
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, mask=mask, cache=cache)
        h = self.norm(h)
        return h, h


def nextn_module(model: Any) -> NextN:
    """An empty :class:`NextN` shaped for ``model`` (an mlx-lm model of NEXTN_FAMILIES)."""
    import importlib

    args = model.args
    family = importlib.import_module(f"mlx_lm.models.{args.model_type}")
    layer = getattr(family, NEXTN_FAMILIES[args.model_type])
    block = layer(args, args.num_hidden_layers)
    return NextN(block, args.hidden_size, args.rms_norm_eps)


@dataclass
class MtpHead:
    """A loaded MTP head and the target's parts it runs with.

    ``trunk(inputs, cache)`` is the target's forward up to its final norm and
    ``head(hidden)`` its output projection: ``head(trunk(x))`` is the target's
    own forward, so a verify step run through them gives the same logits and
    keeps the hidden states the head needs.
    """

    module: NextN | QwenMtp
    trunk: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]
    embed: Callable[[mx.array], mx.array]
    family: str
    weights_bytes: int
    layers: int = 1

    def make_cache(self) -> list[Any]:
        if self.family == "deepseek_v32":  # its attention keeps the indexer's keys beside
            return [CacheList(KVCache(), KVCache())]
        return [KVCache() for _ in range(self.layers)]


def target_parts(model: Any) -> tuple[Callable[..., mx.array], Callable, Callable]:
    """(trunk, head, embed) of an mlx-lm model of NEXTN_FAMILIES or QWEN_FAMILIES."""
    lm = getattr(model, "language_model", model)
    inner = lm.model
    head = getattr(lm, "lm_head", None)
    return inner, inner.embed_tokens.as_linear if head is None else head, inner.embed_tokens
