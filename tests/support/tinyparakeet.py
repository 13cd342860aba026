"""A tiny random-weight Parakeet (TDT) for ``kind = "transcription"`` (issue 37), built offline.

mlx-audio's own Parakeet classes (``Model.from_config`` from
``mlx_audio.stt.models.parakeet`` builds its ``ParakeetTDT``: one 32-wide
Conformer layer over 16 mel bins, an LSTM prediction network, a TDT joint)
with random weights, and the NeMo-shaped ``config.json`` that
``mlx_audio.stt.load`` reads from a converted Parakeet directory (``target``
names NeMo's class; ``model_type`` is left out, as NeMo's configs have it).
Its vocabulary is ten SentencePiece-style pieces, so its transcripts are
words in a random order. Built once and cached by content, like
:mod:`tests.support.tinymodels`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.tinymodels import build_once, cache_root

CONTENT_VERSION = "p1"

VOCABULARY = ["<unk>", "▁the", "▁river", "▁boat", "s", "▁rock", "▁gent", "ly", "▁hello", "▁world"]
DURATIONS = [0, 1, 2, 3, 4]

CONFIG: dict[str, Any] = {
    "target": "nemo.collections.asr.models.rnnt_bpe_models.EncDecRNNTBPEModel",
    "model_defaults": {"tdt_durations": DURATIONS},
    "preprocessor": {
        "sample_rate": 16000,
        "normalize": "per_feature",
        "window_size": 0.025,
        "window_stride": 0.01,
        "window": "hann",
        "features": 16,
        "n_fft": 512,
        "dither": 0.0,
    },
    "encoder": {
        "feat_in": 16,
        "n_layers": 1,
        "d_model": 32,
        "n_heads": 2,
        "ff_expansion_factor": 2,
        "subsampling_factor": 8,
        "self_attention_model": "rel_pos",
        "subsampling": "dw_striding",
        "conv_kernel_size": 9,
        "subsampling_conv_channels": 16,
        "pos_emb_max_len": 5000,
    },
    "decoder": {
        "blank_as_pad": True,
        "vocab_size": len(VOCABULARY),
        "prednet": {"pred_hidden": 32, "pred_rnn_layers": 1},
    },
    "joint": {
        "num_classes": len(VOCABULARY),
        "vocabulary": VOCABULARY,
        "jointnet": {
            "joint_hidden": 32,
            "activation": "relu",
            "encoder_hidden": 32,
            "pred_hidden": 32,
        },
        "num_extra_outputs": len(DURATIONS),
    },
    "decoding": {"model_type": "tdt", "durations": DURATIONS, "greedy": {"max_symbols": 2}},
}


def build_tiny_parakeet(out: Path, *, seed: int = 0) -> Path:
    """Write the config and random weights into ``out``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.stt.models.parakeet import Model

    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = Model.from_config(CONFIG)  # the class NeMo's target names (ParakeetTDT)
    (out / "config.json").write_text(json.dumps(CONFIG))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def tiny_parakeet_dir(*, seed: int = 0) -> Path:
    """A cached build under ``<cache_root()>/p1/parakeet-<seed>``."""
    final = cache_root() / CONTENT_VERSION / f"parakeet-{seed}"
    return build_once(final, lambda tmp: build_tiny_parakeet(tmp, seed=seed))
