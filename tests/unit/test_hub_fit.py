"""The fit check before a download (mlxd/hub/fit.py): pure numbers in, a verdict out."""

from __future__ import annotations

from mlxd.hub import fit_verdict, kv_bytes_per_token
from mlxd.hub.fit import context_length

GiB = 1024**3
LLAMA = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}


def test_kv_bytes_per_token_from_config_json():
    # 2 (K and V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes
    assert kv_bytes_per_token(LLAMA) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token({**LLAMA, "torch_dtype": "float32"}) == 2 * 32 * 8 * 128 * 4
    assert kv_bytes_per_token({**LLAMA, "head_dim": 64}) == 2 * 32 * 8 * 64 * 2
    # A vision-language model keeps its language model's numbers in text_config.
    assert kv_bytes_per_token({"model_type": "x", "text_config": LLAMA}) == 131072
    # Only attention layers hold KV.
    hybrid = {**LLAMA, "layer_types": ["linear_attention", "full_attention", "mamba"] * 2}
    assert kv_bytes_per_token(hybrid) == 2 * 4 * 8 * 128 * 2
    assert kv_bytes_per_token({"model_type": "x"}) is None
    assert context_length(LLAMA) == 131072


def test_kv_bits_shrink_the_estimate_as_mlx_stores_quantized_values():
    """[batch] kv_bits: the fit check counts the quantized cache, as mx.quantize stores it."""
    import mlx.core as mx

    for bits, group in ((8, 64), (4, 64), (4, 32)):
        head = mx.zeros((1, 128), dtype=mx.bfloat16)  # one KV head's values for one token
        stored = sum(a.nbytes for a in mx.quantize(head, group_size=group, bits=bits))
        assert kv_bytes_per_token(LLAMA, bits, group) == 2 * 32 * 8 * stored, (bits, group)
    assert 1.8 * (kv_bytes_per_token(LLAMA, 8) or 0) < (kv_bytes_per_token(LLAMA) or 0)
    assert kv_bytes_per_token(LLAMA, 0) == kv_bytes_per_token(LLAMA)


def test_a_model_larger_than_the_budget_does_not_fit():
    v = fit_verdict(weights=20 * GiB, kv_per_token=131072, budget=16 * GiB)
    assert not v.fits
    assert v.message == "does not fit: 20.0 GiB of weights against a 16.0 GiB budget"
    beside = fit_verdict(weights=10 * GiB, kv_per_token=131072, budget=16 * GiB, others=8 * GiB)
    assert not beside.fits and "8.0 GiB of it held by other pinned models" in beside.message


def test_a_model_that_fits_says_how_much_context_it_leaves():
    v = fit_verdict(
        weights=4 * GiB, kv_per_token=131072, budget=8 * GiB, reserve=1 * GiB, max_context=None
    )
    assert v.fits and v.tokens == 3 * GiB // 131072
    assert v.message.startswith(f"fits, with room for {v.tokens:,} tokens of context")
    whole = fit_verdict(weights=GiB, kv_per_token=1024, budget=8 * GiB, max_context=32768)
    assert whole.tokens == 32768 and "its whole context" in whole.message
    # Weights fit, but the prompt cache's reserve leaves nothing for KV.
    tight = fit_verdict(weights=7 * GiB, kv_per_token=1024, budget=8 * GiB, reserve=GiB)
    assert not tight.fits and "prompt-cache reserve" in tight.message
