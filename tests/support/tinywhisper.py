"""A tiny random-weight Whisper for ``kind = "transcription"`` (issue 37), built offline.

mlx-audio's own Whisper ``Model`` (one encoder and one decoder layer, 64 wide,
80 mel bins) with random weights, a byte-level BPE tokenizer trained here
with Whisper's special tokens (languages, tasks, timestamps), and a saved
``WhisperProcessor``: what ``mlx_audio.stt.load`` reads from a Hugging Face
Whisper directory. Its transcripts are noise; the tests check their shape.
Built once and cached by content, like :mod:`tests.support.tinymodels`.

The default one says nothing: its ``<|endoftext|>`` is token 0, so mlx-audio
(which keeps tokens below ``eot`` as text, as in Whisper's vocabulary) finds no
words, and each window ends fast. ``talkative=True`` puts ``<|endoftext|>``
after the words as Whisper does and scales the word tokens' embeddings, so the
tied output head favours them over the 1501 timestamp tokens: 32 tokens of
words per 30 s window (the streamed-transcript tests need text; it is slower).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.tinymodels import build_once, cache_root

CONTENT_VERSION = "w1"

CONFIG: dict[str, Any] = {
    "model_type": "whisper",
    "n_mels": 80,
    "n_audio_ctx": 1500,
    "n_audio_state": 64,
    "n_audio_head": 2,
    "n_audio_layer": 1,
    "n_text_ctx": 64,  # bounds what the random decoder can generate per window
    "n_text_state": 64,
    "n_text_head": 2,
    "n_text_layer": 1,
}

WORD_SCALE = 8.0  # talkative: the word tokens' embeddings times this


def build_tiny_whisper(out: Path, *, seed: int = 0, talkative: bool = False) -> Path:
    """Write the tokenizer, processor, config and random weights into ``out``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[] if talkative else ["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world the river boats rock gently"] * 10, trainer)
    specials = (
        (["<|endoftext|>"] if talkative else [])
        + ["<|startoftranscript|>"]
        + [f"<|{code}|>" for code in LANGUAGES]
        + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>"]
        + ["<|nospeech|>", "<|notimestamps|>"]
        + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    )
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    end = "<|endoftext|>"
    hf = WhisperTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"),
        bos_token=end,
        eos_token=end,
        unk_token=end,
        pad_token=end,
    )
    WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=hf
    ).save_pretrained(str(out))
    config = {**CONFIG, "n_vocab": len(hf)}
    mx.random.seed(seed)
    model = Model(ModelDimensions.from_dict(config))
    if talkative:
        words = [hf.decode([i]).strip() for i in range(hf.convert_tokens_to_ids(end))]
        scale = [WORD_SCALE if w.isascii() and w.isalpha() else 1.0 for w in words]
        scale += [1.0] * (config["n_vocab"] - len(scale))
        weight = model.decoder.token_embedding.weight
        model.decoder.token_embedding.weight = weight * mx.array(scale)[:, None]
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def tiny_whisper_dir(*, seed: int = 0, talkative: bool = False) -> Path:
    """A cached build under ``<cache_root()>/w1/whisper[-talkative]-<seed>``."""
    name = f"whisper-talkative-{seed}" if talkative else f"whisper-{seed}"
    final = cache_root() / CONTENT_VERSION / name
    return build_once(final, lambda tmp: build_tiny_whisper(tmp, seed=seed, talkative=talkative))
