"""A tiny random-weight Soprano text-to-speech model for ``kind = "speech"`` (issue 37).

Soprano (mlx-audio's ``soprano`` family: a Qwen3 language model whose hidden
states a Vocos decoder turns into 32 kHz audio) is the cheapest mlx-audio TTS
family that runs fully offline: its text goes through a Hugging Face tokenizer,
no phonemizer (Kokoro needs misaki, KittenTTS espeak through phonemizer), and
it has no codec or speaker model to download. Built here with mlx-audio's own
``Model`` and a character-level tokenizer trained here; ``mlx_audio.tts.load``
reads the directory like a Hugging Face Soprano conversion.

The language model is random except for a few weights that make its output
deterministic and short: the layer's output projections are zero (the hidden
state is the token's embedding), the embeddings are one-hot, and the LM head
maps ``[START]`` to token A, A to B, B to C and every other token to
``[STOP]``, each by a margin no sampling temperature crosses. So every
sentence is three audio tokens: ``4 * 2048 - 2048 = 6144`` samples (0.192 s),
and a text of N lines is N segments. The decoder's weights stay random: the
audio is noise, of a known length. ``voices/`` holds two placeholder files
(:data:`VOICES`), so the tests reach mlxd's voice check as a Kokoro
directory's voices would; Soprano ignores the voice it is passed. Built once and cached, like
:mod:`tests.support.tinywhisper`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.tinymodels import build_once, cache_root

CONTENT_VERSION = "t2"

# What one sentence (one line of input) becomes: 6144 samples at 32 kHz.
SAMPLE_RATE = 32_000
SAMPLES_PER_LINE = 6144
# Placeholder voice files in voices/ (the layout Kokoro's voices have): mlxd lists and
# checks them; Soprano itself has one voice and ignores the name it is given.
VOICES = ("af_tiny", "am_tiny")

HIDDEN = 64
CONFIG: dict[str, Any] = {
    "model_type": "soprano",
    "hidden_size": HIDDEN,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "sample_rate": SAMPLE_RATE,
}


def _tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    alphabet = [chr(c) for c in range(32, 127)]
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + 8,
        special_tokens=["[UNK]", "[STOP]", "[TEXT]", "[START]", "[A]", "[B]", "[C]"],
        initial_alphabet=alphabet,
    )
    tok.train_from_iterator(["hello world"], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[STOP]")
    hf.save_pretrained(str(out))
    return hf


def build_tiny_tts(out: Path, *, seed: int = 0) -> Path:
    """Write the tokenizer, config and weights (random, then the chain above) into ``out``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.soprano.soprano import Model, ModelConfig

    out.mkdir(parents=True, exist_ok=True)
    hf = _tokenizer(out)
    vocab = len(hf)
    config = {**CONFIG, "vocab_size": vocab}
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict({**config, "model_path": str(out)}))
    lm = model.language_model
    ids = {name: hf.convert_tokens_to_ids(name) for name in ("[START]", "[A]", "[B]", "[C]")}
    stop = hf.convert_tokens_to_ids("[STOP]")
    # The hidden state is the embedding: one-hot, dim 0..2 for [START], [A], [B], 3 else.
    embed = mx.zeros((vocab, HIDDEN)).at[:, 3].add(1.0)
    for dim, name in enumerate(("[START]", "[A]", "[B]")):
        row = mx.zeros((HIDDEN,)).at[dim].add(1.0)
        embed[ids[name]] = row
    head = mx.zeros((vocab, HIDDEN))
    for dim, name in enumerate(("[A]", "[B]", "[C]")):
        head[ids[name]] = mx.zeros((HIDDEN,)).at[dim].add(10.0)
    head[stop] = mx.zeros((HIDDEN,)).at[3].add(10.0)
    lm.embed_tokens.weight = embed
    lm.lm_head.weight = head
    for layer in lm.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    (out / "config.json").write_text(json.dumps(config))
    (out / "voices").mkdir()
    for voice in VOICES:
        (out / "voices" / f"{voice}.safetensors").write_bytes(b"placeholder")
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def tiny_tts_dir(*, seed: int = 0) -> Path:
    """A cached build under ``<cache_root()>/t2/soprano-<seed>``."""
    final = cache_root() / CONTENT_VERSION / f"soprano-{seed}"
    return build_once(final, lambda tmp: build_tiny_tts(tmp, seed=seed))
