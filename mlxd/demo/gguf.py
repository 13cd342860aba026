"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

MLX reads GGUF natively (``mx.load``): Q4_0/Q4_1/Q8_0 tensors arrive as MLX
affine-quantized triples (packed ``uint32`` weight, ``float16`` scales and
biases, group size 32), everything else as plain arrays. This module renames
the tensors to the Hugging Face layout mlx-lm expects, undoes llama.cpp's
RoPE row permutation of the q/k projections, optionally dequantizes, and
rebuilds ``tokenizer.json`` from the GGUF vocabulary with ``tokenizers``.

Nothing here touches MLX at import time, and the conversion only uses the
calling thread's default stream, so it may run on any thread.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

__all__ = ["CONVERTER_VERSION", "DTYPES", "GGUFConversionError", "convert_gguf"]

logger = logging.getLogger(__name__)

# Part of the cache directory name: bump it whenever the files convert_gguf
# writes change, so stale conversions are never picked up.
CONVERTER_VERSION = 1

DTYPES = ("q4", "bfloat16", "float32")
# config.json's informational torch_dtype: q4 keeps the GGUF's float16 scales.
_TORCH_DTYPE = {"q4": "float16", "bfloat16": "bfloat16", "float32": "float32"}

# GGUF's native block size for Q4_0, Q4_1 and Q8_0, which MLX maps to groups.
_GGUF_GROUP_SIZE = 32

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# llama.cpp token types (llama_token_type): control tokens become special added
# tokens; user-defined ones become non-special added tokens.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class GGUFConversionError(ValueError):
    """The GGUF file holds something this converter does not handle."""


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Write an mlx-lm model directory converted from a llama GGUF file.

    Writes ``config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json`` and
    ``generation_config.json`` into ``out_dir`` (created if missing).

    Args:
        gguf_path: The ``.gguf`` file, llama architecture, with tensors in types
            MLX loads as affine-quantized (Q4_0, Q4_1, Q8_0) or as floats.
        out_dir: Destination directory; existing files of the same names are
            overwritten.
        dtype: ``"q4"`` keeps the GGUF's quantized tensors as they are;
            ``"bfloat16"`` and ``"float32"`` dequantize every tensor to that type.

    Raises:
        ValueError: ``dtype`` is not one of :data:`DTYPES`.
        GGUFConversionError: The file is not a llama GGUF this converter handles.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors, meta = cast(
        "tuple[dict[str, mx.array], dict[str, Any]]",  # what return_metadata=True gives for a GGUF
        mx.load(str(gguf_path), return_metadata=True),
    )
    try:
        config = _model_config(meta, tensors)
        weights, quantization = _convert_tensors(tensors, config, dtype)
        del tensors
        if quantization:
            config["quantization"] = quantization
            config["quantization_config"] = quantization
        config["torch_dtype"] = _TORCH_DTYPE[dtype]
        config["mlxd_conversion"] = {
            "converter_version": CONVERTER_VERSION,
            "dtype": dtype,
            "source": Path(gguf_path).name,
        }
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        _write_json(out_dir / "config.json", config)
        _write_tokenizer(meta, out_dir, config)
    finally:
        # Give the conversion's buffers back instead of keeping them cached for
        # a model that is loaded afresh from disk right after.
        mx.clear_cache()


def _meta_value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _model_config(meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"only llama GGUF files are supported, got {arch!r}")
    if "llama.rope.scaling.type" in meta:
        raise GGUFConversionError("GGUF files with RoPE scaling are not supported")

    def need(key: str) -> Any:
        value = _meta_value(meta, f"llama.{key}")
        if value is None:
            raise GGUFConversionError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_meta_value(meta, "llama.attention.head_count_kv", heads))
    head_dim = int(_meta_value(meta, "llama.rope.dimension_count", hidden // heads))
    vocab = len(meta["tokenizer.ggml.tokens"])
    # GGUF stores eps as float32: round away the float32 noise (1e-05, not 9.9999997e-06).
    eps = float(f"{float(need('attention.layer_norm_rms_epsilon')):.7g}")
    bos = _meta_value(meta, "tokenizer.ggml.bos_token_id")
    eos = _meta_value(meta, "tokenizer.ggml.eos_token_id")
    pad = _meta_value(meta, "tokenizer.ggml.padding_token_id")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "rope_theta": float(_meta_value(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if value is not None:
            config[key] = int(value)
    return config


def _hf_name(gguf_name: str) -> str:
    """Map ``blk.3.attn_q.scales`` to ``model.layers.3.self_attn.q_proj.scales``."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, kind = stem.split(".", 2)
        if kind in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{leaf}"
    elif stem in _TOP_TENSORS:
        return f"{_TOP_TENSORS[stem]}.{leaf}"
    raise GGUFConversionError(f"unexpected tensor in GGUF: {gguf_name}")


def _unpermute_rope(rows: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation, so mlx-lm's non-traditional RoPE applies.

    llama.cpp reorders each head's rows from ``[first half, second half]`` to
    interleaved pairs for its GPT-J style RoPE. Only rows move, so this is
    exact on packed quantized weights and on their per-row scales and biases.
    """
    shape = rows.shape
    head_rows = shape[0] // n_heads
    return rows.reshape(n_heads, head_rows // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _convert_tensors(
    tensors: dict[str, mx.array], config: dict[str, Any], dtype: str
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename, un-permute and (de)quantize; returns weights and mlx-lm's quantization map."""
    renamed = {_hf_name(name): array for name, array in tensors.items()}
    for name, array in renamed.items():
        if ".self_attn.q_proj." in name:
            renamed[name] = _unpermute_rope(array, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            renamed[name] = _unpermute_rope(array, config["num_key_value_heads"])

    target = {"bfloat16": mx.bfloat16, "float32": mx.float32}.get(dtype)
    weights: dict[str, mx.array] = {}
    layer_bits: dict[str, int] = {}
    for name, array in renamed.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.rpartition(".")[0]
        if f"{module}.scales" not in renamed:
            if not mx.issubdtype(array.dtype, mx.floating):
                raise GGUFConversionError(f"{name} has unsupported type {array.dtype}")
            weights[name] = array if target is None else array.astype(target)
            continue
        scales, biases = renamed[f"{module}.scales"], renamed[f"{module}.biases"]
        in_dims = scales.shape[-1] * _GGUF_GROUP_SIZE
        bits = array.shape[-1] * 32 // in_dims
        if bits not in (4, 8):
            raise GGUFConversionError(f"{module} has an unsupported {bits}-bit packing")
        if target is None:
            weights[name], weights[f"{module}.scales"] = array, scales
            weights[f"{module}.biases"] = biases
            layer_bits[module] = bits
        else:
            # Dequantize in float32 and round once to the target type.
            dense = mx.dequantize(
                array,
                scales.astype(mx.float32),
                biases.astype(mx.float32),
                group_size=_GGUF_GROUP_SIZE,
                bits=bits,
            )
            weights[name] = dense.astype(target)
        mx.eval(weights[name])

    if target is None:
        return weights, _quantization_map(layer_bits)
    return weights, None


def _quantization_map(layer_bits: dict[str, int]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` entry: the most common bit width, per-layer exceptions."""
    if not layer_bits:
        return None
    widths = list(layer_bits.values())
    default = max(set(widths), key=widths.count)
    quantization: dict[str, Any] = {
        "group_size": _GGUF_GROUP_SIZE,
        "bits": default,
        "mode": "affine",
    }
    for module, bits in sorted(layer_bits.items()):
        if bits != default:
            quantization[module] = {"group_size": _GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}
    return quantization


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _write_tokenizer(meta: dict[str, Any], out_dir: Path, config: dict[str, Any]) -> None:
    """Rebuild the Hugging Face tokenizer files from the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"only byte-level BPE (gpt2) tokenizers are supported, got {kind!r}"
        )
    if pre not in _PRE_TOKENIZERS:
        raise GGUFConversionError(f"unsupported GGUF pre-tokenizer {pre!r}")

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    if any(len(merge) != 2 for merge in merges):
        raise GGUFConversionError("malformed BPE merge in GGUF metadata")

    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            byte_fallback=False,
            fuse_unk=False,
        )
    )
    steps = []
    if _PRE_TOKENIZERS[pre]:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Tokens already in the vocabulary keep their ids when added.
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def token_for(key: str) -> str | None:
        index = _meta_value(meta, f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    special_map: dict[str, Any] = {
        name: value
        for name, value in (
            ("bos_token", token_for("bos")),
            ("eos_token", token_for("eos")),
            ("unk_token", token_for("unknown")),
            ("pad_token", token_for("padding")),
        )
        if value is not None
    }
    special_map["additional_special_tokens"] = specials
    tokenizer_config: dict[str, Any] = {
        # The generic fast tokenizer loads tokenizer.json as written; a model
        # specific class (GPT2Tokenizer) may rebuild its own pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_meta_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta_value(meta, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        **special_map,
    }
    if template := meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    generation = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if key in config
    }
    _write_json(out_dir / "generation_config.json", generation)


# GGUF pre-tokenizer names whose regex is GPT-2's byte-level split, mapped to
# whether digits are first split one by one (llama.cpp's llama-vocab.cpp).
_PRE_TOKENIZERS = {"gpt-2": False, "smollm": True}
