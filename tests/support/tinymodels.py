"""Tiny random-weight mlx-lm models, one per KV-cache family, for fast real-MLX tests.

Each model is built locally from a config with mlx-lm's own model classes, saved as an
ordinary mlx-lm model directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML template) and loaded by tests with the real
``mlx_lm.load(path)``. Nothing is downloaded: the byte-level BPE tokenizer is trained on the
small corpus below with the ``tokenizers`` library.

Families and their per-layer prompt caches (see :func:`expected_cache_layout`):

- ``llama``: 4 full-attention layers, ``KVCache`` each.
- ``llama_b``: a second llama (other hidden size, depth and seed) for model-swap tests.
- ``gemma3_text``: 6 layers, pattern 3: ``RotatingKVCache(max_size=16)`` on the sliding
  layers 0, 1, 3, 4 and ``KVCache`` on the global layers 2, 5.
- ``qwen3_next`` / ``qwen3_5``: 4 layers alternating gated-delta (``ArraysCache`` holding conv
  and SSM state) and full attention (``KVCache``); dense MLP (``num_experts: 0``).
- ``mamba2``: 4 SSM layers, ``ArraysCache`` only.
- ``falcon_h1``: 2 parallel attention+SSM layers, ``CacheList(ArraysCache, KVCache)``.
- ``llama_kvq`` (``KV_QUANT_FAMILY``, not in ``FAMILIES``): a 2-layer llama with 64-wide
  heads, which MLX can quantize (``[batch] kv_bits``).

Chat-template variants (``template=``, default ``"chatml"``): the same weights and tokenizer
with a tools-capable template, for tool-calling and reasoning tests:

- ``hermes``: Hermes/Qwen ``<tool_call>{json}</tool_call>`` (mlx-lm's ``json_tools`` parser).
- ``mistral``: ``[TOOL_CALLS]name[ARGS]{json}`` (mlx-lm's ``mistral`` parser).
- ``hermes_think``: ``hermes`` plus ``<think>``/``</think>`` added as special tokens (vocab
  514) and a Qwen3-style ``enable_thinking`` generation prompt.

Use :func:`tiny_model_dir` to get a cached build (built once per content key, atomically) or
:func:`build_tiny_model` to write one into a directory of your choosing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = [
    "CHAT_TEMPLATE",
    "CONTENT_VERSION",
    "EOS_TOKEN",
    "FAMILIES",
    "KV_QUANT_FAMILY",
    "LONG_CONTEXT_FAMILY",
    "SLIDING_WINDOW",
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "build_tiny_model",
    "cache_root",
    "expected_cache_layout",
    "family_config",
    "tiny_model_dir",
]

# Bump when anything that changes the built files changes in a way the content key below
# cannot see (it already covers configs, corpus, template and the mlx / mlx-lm versions).
CONTENT_VERSION = "v1"

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB_SIZE = 512
SLIDING_WINDOW = 16
_EOS_ROW_SCALE = 0.5

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first and tools %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\n' }}{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set tc = tool_call.function if tool_call.function is defined else tool_call %}"
    '\n<tool_call>\n{"name": "{{ tc.name }}", "arguments": {{ tc.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'system' %}[SYSTEM_PROMPT]{{ message.content }}[/SYSTEM_PROMPT]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS]"
    "{%- for tool_call in message.tool_calls %}"
    "{{ tool_call.function.name }}[ARGS]{{ tool_call.function.arguments | tojson }}"
    "{%- endfor %}<|im_end|>"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}<|im_end|>"
    "{%- endif %}"
    "{%- endfor %}"
)

_THINK_PROMPT = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}"
)

# template name -> (chat template, tokenizer_config additions, added special tokens)
TEMPLATES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "chatml": (CHAT_TEMPLATE, {}, ()),
    "hermes": (
        _HERMES_TEMPLATE
        + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}",
        {"tool_parser_type": "json_tools"},
        (),
    ),
    "mistral": (_MISTRAL_TEMPLATE, {"tool_parser_type": "mistral"}, ()),
    "hermes_think": (
        _HERMES_TEMPLATE + _THINK_PROMPT,
        {"tool_parser_type": "json_tools"},
        ("<think>", "</think>"),
    ),
}

_CORPUS = """\
The river runs past the old mill every morning, and the people of the town walk along its
banks before the shops open. Some of them carry bread from the bakery on the corner; others
carry nothing at all and simply watch the water. In the spring the river is high and brown,
and in the late summer it is low and clear enough to see the stones on the bottom.

A small computer reads a prompt, turns the words into numbers, and then predicts the next
number again and again until it reaches a stop token or runs out of budget. Each step looks
back at the cached keys and values of every earlier token, so the memory it needs grows with
the length of the conversation. A server that answers many users at once has to decide who
gets that memory, who waits in the queue, and when a long request should be paused.

She opened the window, listened to the rain on the roof, and wrote a short letter to her
brother. "The garden is green again," she wrote. "The apple tree has flowers, the cat sleeps
under the table, and the neighbours have painted their door a bright shade of blue. Come and
visit when the weather is warm; we will cook dinner outside and talk until it is dark."

Numbers such as 1, 2, 3, 10, 42, 100 and 2048 appear in logs, tables and reports. A request
took 12.5 ms, another took 340 ms, and the slowest one finished after 3 seconds. The queue
held 7 requests at noon and 0 requests at midnight. Please keep answers short, clear and
polite; explain the steps in order, and say when you are not sure about something.

Questions are welcome: What time is it? Where does the train stop? Why is the sky blue? How
many tokens fit in the window? Which model should we load next, and what happens to the
requests that are still running when we swap it? The answer is usually simple: finish what
is running, keep the queue in order, and tell everyone what is going on.

A chat transcript has a system message, then the user and the assistant take turns. The
system says: you are a helpful assistant. The user says: hello, can you help me? The
assistant says: of course, what do you need? The user asks a question, the assistant
answers it, and the user thanks the assistant before the system closes the session.

In the evening the lights come on along the harbour, the boats rock gently at their ropes,
and the fishermen mend their nets while the children play on the wooden pier. The smell of
salt and smoke drifts over the water, a dog barks somewhere in the hills, and the last bus
leaves the square at ten o'clock sharp, full of tired workers going home to their families.
"""

# Per-family model configs, without the tokenizer-dependent keys (vocab size and special
# token ids, filled in by ``family_config``). Shapes are tiny on purpose: a forward pass on
# a handful of tokens takes milliseconds on the CPU backend.
_FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "llama_b": {
        "model_type": "llama",
        "hidden_size": 96,
        "num_hidden_layers": 3,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 16,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 3,
        "max_position_embeddings": 4096,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0,
        "mlp_only_layers": [],
        "moe_intermediate_size": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096,
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        "max_position_embeddings": 4096,
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
    },
    "mamba2": {
        "model_type": "mamba2",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_heads": 4,
        "head_dim": 16,
        "intermediate_size": 64,
        # transformers' Mamba2Config (which AutoTokenizer loads) checks expand * hidden.
        "expand": 1,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, 1e9],
        "time_step_rank": "auto",
        "tie_word_embeddings": False,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 1,
        "mamba_chunk_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}

# A llama whose config declares a long context, for real agents' prompts (tens of
# thousands of tokens of system prompt and tools): tests/agents. Not in FAMILIES (it
# is the llama family again), so the per-family tests do not run it twice.
LONG_CONTEXT_FAMILY = "llama_long"
_FAMILY_CONFIGS[LONG_CONTEXT_FAMILY] = {
    **_FAMILY_CONFIGS["llama"],
    "max_position_embeddings": 131072,
}

# A llama whose heads are 64 wide, as MLX's KV quantization needs (its groups are 32, 64
# or 128 values; the llama's 16-wide heads cannot be quantized): quantized-KV tests.
# Not in FAMILIES either.
KV_QUANT_FAMILY = "llama_kvq"
_FAMILY_CONFIGS[KV_QUANT_FAMILY] = {
    **_FAMILY_CONFIGS["llama"],
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}

FAMILIES: tuple[str, ...] = tuple(
    f for f in _FAMILY_CONFIGS if f not in (LONG_CONTEXT_FAMILY, KV_QUANT_FAMILY)
)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def expected_cache_layout(family: str) -> list[str]:
    """Per-layer cache class names ``make_prompt_cache`` should give for ``family``.

    ``CacheList`` entries are spelled ``"CacheList(ArraysCache,KVCache)"``.
    """
    cfg = _spec(family)
    n = cfg["num_hidden_layers"]
    model_type = cfg["model_type"]
    if model_type == "llama":
        return ["KVCache"] * n
    if model_type == "gemma3_text":
        p = cfg["sliding_window_pattern"]
        return ["KVCache" if i % p == p - 1 else "RotatingKVCache" for i in range(n)]
    if model_type in ("qwen3_next", "qwen3_5"):
        k = cfg["full_attention_interval"]
        return ["KVCache" if (i + 1) % k == 0 else "ArraysCache" for i in range(n)]
    if model_type == "mamba2":
        return ["ArraysCache"] * n
    if model_type == "falcon_h1":
        return ["CacheList(ArraysCache,KVCache)"] * n
    raise AssertionError(f"no cache layout for {family}")


def _spec(family: str) -> dict[str, Any]:
    try:
        return _FAMILY_CONFIGS[family]
    except KeyError:
        raise ValueError(f"unknown tiny model family {family!r}; known: {FAMILIES}") from None


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer once per process; returns its JSON text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=8)
def _tokenizer_json_with(added: tuple[str, ...]) -> str:
    """The trained tokenizer, with ``added`` special tokens appended after its vocab."""
    if not added:
        return _tokenizer_json()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json())
    tok.add_special_tokens(list(added))
    return tok.to_str()


def _special_ids(added: tuple[str, ...] = ()) -> dict[str, int]:
    tokens = json.loads(_tokenizer_json_with(added))["added_tokens"]
    return {t["content"]: t["id"] for t in tokens}


def _vocab_size(added: tuple[str, ...] = ()) -> int:
    tok = json.loads(_tokenizer_json())
    return len(tok["model"]["vocab"]) + len(added)


def family_config(family: str, added: tuple[str, ...] = ()) -> dict[str, Any]:
    """The full ``config.json`` content for ``family`` (vocab and special ids filled in)."""
    cfg = copy.deepcopy(_spec(family))
    ids = _special_ids()
    cfg["vocab_size"] = _vocab_size(added)
    cfg["eos_token_id"] = ids[EOS_TOKEN]
    cfg["pad_token_id"] = ids[PAD_TOKEN]
    cfg["bos_token_id"] = None
    return cfg


def _tokenizer_config(template: str = "chatml") -> dict[str, Any]:
    chat_template, extra, added = TEMPLATES[template]
    ids = _special_ids(added)
    return {
        **extra,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "added_tokens_decoder": added_tokens_decoder(ids),
    }


def added_tokens_decoder(ids: dict[str, int]) -> dict[str, dict[str, Any]]:
    """``tokenizer_config.json``'s ``added_tokens_decoder`` for special tokens ``ids``."""
    return {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok, i in sorted(ids.items(), key=lambda kv: kv[1])
    }


def _rng_for(family: str, seed: int) -> np.random.Generator:
    digest = hashlib.sha256(f"{family}:{seed}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _random_weights(params: dict[str, mx.array], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Draw every weight from ``rng`` in sorted-name order so builds are reproducible.

    MLX's default init makes most of these tiny models emit one token forever; a wider
    spread (std 2/sqrt(fan_in)) gives varied greedy continuations. Norm scales and the SSM
    skip ``D`` keep the model's own deterministic defaults.
    """
    out: dict[str, np.ndarray] = {}
    for name in sorted(params):
        shape = tuple(params[name].shape)
        leaf = name.rsplit(".", 1)[-1]
        if "embed" in name:
            w = rng.normal(0.0, 0.02, shape)
        elif len(shape) >= 2:
            fan_in = int(np.prod(shape[1:]))
            w = rng.normal(0.0, 2.0 / np.sqrt(fan_in), shape)
        elif leaf == "A_log":
            # qwen3_next / qwen3_5 draw A from MLX's global RNG: pin it here instead.
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif leaf == "dt_bias":
            # Mamba's own init (step sizes in [1e-3, 1e-1] through softplus): with the
            # constructors' ones the SSM state forgets within a token or two and every
            # chat-templated prompt continues identically.
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
            w = dt + np.log(-np.expm1(-dt))
        elif leaf == "bias":
            w = np.zeros(shape)
        else:
            w = np.array(params[name].astype(mx.float32))
        out[name] = w.astype(np.float32)
    return out


def build_tiny_model(
    family: str,
    out_dir: Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    template: str = "chatml",
) -> Path:
    """Write a random-weight mlx-lm model directory for ``family`` into ``out_dir``.

    The result is deterministic for a given ``(family, dtype, seed, template)`` (and mlx-lm
    version) and loads with ``mlx_lm.load(out_dir)``. Returns ``out_dir``.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, not {template!r}")
    chat_template, _, added = TEMPLATES[template]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = family_config(family, added)
    config["torch_dtype"] = dtype

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    if config["model_type"] == "gemma3_text":
        # Gemma3 ties the output projection to the embeddings: sanitize() drops the
        # always-built lm_head when the checkpoint lacks it, as real checkpoints do.
        params.pop("lm_head.weight", None)
    weights = _random_weights(params, _rng_for(family, seed))
    head = next((w for name, w in weights.items() if name.endswith("lm_head.weight")), None)
    if head is not None:
        # Random heads put EOS on top within 20 tokens for up to a fifth of prompts; tests
        # want rows that run to max_tokens, so shrink the EOS row. Greedy EOS becomes rare
        # (none in 32 prompts x 256 tokens); stop on an ordinary token to test stopping.
        head[config["eos_token_id"]] *= _EOS_ROW_SCALE

    target = _DTYPES[dtype]
    keep_fp32 = getattr(model, "cast_predicate", lambda _path: True)
    arrays = {
        name: mx.array(w).astype(target if keep_fp32(name) else mx.float32)
        for name, w in weights.items()
    }
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})

    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer.json").write_text(_tokenizer_json_with(added))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(template), indent=2) + "\n"
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2) + "\n"
    )
    (out_dir / "chat_template.jinja").write_text(chat_template + "\n")
    return out_dir


def cache_root() -> Path:
    """``$MLXD_CACHE_DIR/tiny-models`` if set, else ``~/.cache/mlxd/tiny-models``."""
    base = os.environ.get("MLXD_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "mlxd"
    return root / "tiny-models"


def _content_key(family: str, template: str = "chatml") -> str:
    import mlx_lm

    variant = {} if template == "chatml" else {"variant": TEMPLATES[template]}
    blob = json.dumps(
        {
            **variant,
            "version": CONTENT_VERSION,
            "config": _spec(family),
            "corpus": _CORPUS,
            "template": CHAT_TEMPLATE,
            "vocab": TOKENIZER_VOCAB_SIZE,
            "eos_row_scale": _EOS_ROW_SCALE,
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_model_dir(
    family: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    cache_dir: Path | None = None,
    template: str = "chatml",
) -> Path:
    """A cached build of ``family``, built on first use and reused afterwards.

    Lives under ``<cache_root()>/<CONTENT_VERSION>/<family>-<dtype>-<seed>-<key>`` where
    ``key`` hashes the config, corpus, template and mlx / mlx-lm versions, so an edit
    to any of them builds afresh. The build goes to a temporary sibling directory that is
    renamed into place, so a reader never sees a half-written model and two racing
    processes both end up with the same complete directory.
    """
    _spec(family)
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / CONTENT_VERSION
    name = family if template == "chatml" else f"{family}+{template}"
    final = root / f"{name}-{dtype}-{seed}-{_content_key(family, template)}"
    return build_once(
        final, lambda tmp: build_tiny_model(family, tmp, dtype=dtype, seed=seed, template=template)
    )


def build_once(final: Path, build: Callable[[Path], object]) -> Path:
    """``final``, built by ``build(tmp)`` into a temporary sibling and renamed into place.

    A reader never sees a half-written model, and two racing processes both end up
    with the same complete directory.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost the race: another process renamed its complete build into place first.
            if not final.is_dir():
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return final
