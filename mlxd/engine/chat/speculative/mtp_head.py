"""An MTP head: the multi-token-prediction layer a checkpoint carries, as an MLX module.

GLM-4.5 (``glm4_moe``) and GLM-4.7-Flash (``glm4_moe_lite``) keep one such
layer after their decoder layers, as ``model.layers.<num_hidden_layers>.*``
(DeepSeek-V3's layout; mlx-lm's ``deepseek_v3`` drops its layer 61 by number,
so its tiny test models cannot be built, and it is not enabled): given the
target's last hidden state ``h_t`` (after its final norm, what its output
head reads) and the embedding of the token after it, ``x_{t+1}``, it
predicts ``x_{t+2}``::

    h = eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])
    h = decoder_layer(h)             # attention over the MTP layer's own KV
    logits = lm_head(shared_head.norm(h))

The embedding and output head are the target's (the checkpoint's
``embed_tokens`` and ``shared_head.head`` copies of them are not loaded).
Drafting deeper than one token feeds ``h`` back in as the next ``h_t``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

# Families whose MTP layout this module reads (config model_type, which is also
# the mlx-lm module), with their decoder layer's class in that module.
NEXTN_FAMILIES: dict[str, str] = {
    "glm4_moe": "DecoderLayer",  # GLM-4.5, 4.6, 4.7
    "glm4_moe_lite": "Glm4MoeLiteDecoderLayer",  # GLM-4.7-Flash (MLA attention)
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
        self, embeds: mx.array, hidden: mx.array, cache: KVCache
    ) -> tuple[mx.array, mx.array]:
        """(what the output head reads, the hidden state the next draft step takes)."""
        h = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(h, cache, return_array=True)
        h = self.block(h, mask, cache)
        return self.shared_head.norm(h), h


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

    module: NextN
    trunk: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]
    embed: Callable[[mx.array], mx.array]
    family: str
    weights_bytes: int

    def make_cache(self) -> list[KVCache]:
        return [KVCache()]


def target_parts(model: Any) -> tuple[Callable[..., mx.array], Callable, Callable]:
    """(trunk, head, embed) of an mlx-lm model of NEXTN_FAMILIES."""
    return model.model, model.lm_head, model.model.embed_tokens
