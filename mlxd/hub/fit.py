"""The fit check before a download: the weights and the KV cache against the memory budget.

Pure: numbers from the hub's listing and ``config.json`` in, a verdict out.
The weights are the ``*.safetensors`` bytes (what loading them holds); the
KV cache's bytes per token are ``2 · attention layers · KV heads · head_dim
· dtype bytes`` (docs/performance.md), at the dtype ``config.json`` names
(the activations of a quantized model are its scales' dtype, 16-bit in
practice). Models whose layers are not all attention (sliding windows,
SSM state) hold less than this for long contexts: the check errs on the
side of caution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxd.config import format_bytes

GiB = 1024**3
_DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language model keeps its language model's numbers in ``text_config``."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def kv_bytes_per_token(
    config: dict[str, Any], kv_bits: int = 0, kv_group_size: int = 64
) -> int | None:
    """KV-cache bytes one token of context holds, or None when config.json does not say.

    ``kv_bits`` ([batch] kv_bits, 4 or 8): the keys and values quantized as MLX
    stores them, ``kv_bits`` per value plus one scale and one bias in the model's
    dtype per ``kv_group_size`` values.
    """
    c = _text_config(config)
    layers = _int(c, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(c, "num_attention_heads", "n_head")
    if layers is None or heads is None:
        return None
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        layers = sum(1 for t in types if isinstance(t, str) and "attention" in t) or layers
    kv_heads = _int(c, "num_key_value_heads", "num_kv_heads") or heads
    hidden = _int(c, "hidden_size", "n_embd")
    head_dim = _int(c, "head_dim") or (hidden // heads if hidden else None)
    if head_dim is None:
        return None
    dtype = c.get("torch_dtype") or c.get("dtype") or "bfloat16"
    width = _DTYPE_BYTES.get(str(dtype), 2)
    if kv_bits:
        per_head = head_dim * kv_bits // 8 + 2 * width * -(-head_dim // kv_group_size)
        return 2 * layers * kv_heads * per_head
    return 2 * layers * kv_heads * head_dim * width


def context_length(config: dict[str, Any]) -> int | None:
    """The context the model declares."""
    return _int(_text_config(config), "max_position_embeddings", "n_positions", "max_seq_len")


@dataclass(frozen=True)
class FitVerdict:
    """Whether the model fits, the context it leaves room for, and the sentence that says so."""

    fits: bool
    tokens: int | None
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "tokens": self.tokens, "message": self.message}


def _gib(n: int) -> str:
    return format_bytes(n)


def fit_verdict(
    *,
    weights: int,
    kv_per_token: int | None,
    budget: int,
    others: int = 0,
    reserve: int = 0,
    max_context: int | None = None,
) -> FitVerdict:
    """Does a model of ``weights`` bytes fit in ``budget`` beside ``others`` (held by other
    models that stay loaded) and its own ``reserve`` (the prompt cache's cap)?"""
    available = budget - others
    beside = f" ({_gib(others)} of it held by other pinned models)" if others > 0 else ""
    if weights > available:
        return FitVerdict(
            False,
            0,
            f"does not fit: {_gib(weights)} of weights against a {_gib(budget)} budget{beside}",
        )
    room = available - weights - reserve
    if room <= 0:
        return FitVerdict(
            False,
            0,
            f"does not fit: {_gib(weights)} of weights and a {_gib(reserve)} prompt-cache "
            f"reserve against a {_gib(budget)} budget{beside}",
        )
    if not kv_per_token:
        return FitVerdict(
            True, None, f"fits: {_gib(weights)} of weights, {_gib(room)} left for its KV cache"
        )
    tokens = room // kv_per_token
    if tokens < 1:
        return FitVerdict(
            False, 0, f"does not fit: no room for one token of context after {_gib(weights)}"
        )
    if max_context and tokens >= max_context:
        return FitVerdict(
            True,
            max_context,
            f"fits, with room for {max_context:,} tokens of context (its whole context; "
            f"{_gib(weights)} of weights in a {_gib(budget)} budget)",
        )
    return FitVerdict(
        True,
        tokens,
        f"fits, with room for {tokens:,} tokens of context ({_gib(weights)} of weights in "
        f"a {_gib(budget)} budget)",
    )
