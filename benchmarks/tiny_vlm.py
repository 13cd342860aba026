#!/usr/bin/env python
"""Build a tiny random-weight vision-language model directory, to try images offline.

The demo model is text-only; this writes an ordinary mlx-vlm model directory
(``config.json``, ``model.safetensors``, a tokenizer, the image processor's files)
built with mlx-vlm's own classes and random weights, the one the tests use. Its
answers are gibberish, but everything around them is real: the processor resizes
and splits the image, the vision tower runs, image tokens count in ``usage``, a
second turn about the same image is served from the prompt cache.

Usage (from a checkout or an unpacked sdist, with mlx-vlm installed)::

    python benchmarks/tiny_vlm.py --family qwen2_vl --out ~/models/tiny-qwen2-vl
    mlxd serve --model ~/models/tiny-qwen2-vl   # or path = "..." in [model]

Families: llava, gemma3 (ordinary positions); qwen2_vl, qwen2_5_vl, qwen3_vl,
qwen3_vl_moe, qwen3_5, qwen3_5_moe (multimodal rotary positions). Qwen images
become one token per 28x28 pixels, between 56x56 and 112x112 pixels after resizing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from tests.support.tinyvlms import FAMILIES, build_tiny_vlm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="qwen2_vl")
    p.add_argument("--out", type=Path, required=True, help="the directory to write")
    p.add_argument("--seed", type=int, default=0, help="another seed, other random weights")
    args = p.parse_args(argv)
    out = args.out.expanduser()
    if out.exists() and any(out.iterdir()):
        p.error(f"{out} exists and is not empty")
    build_tiny_vlm(args.family, out, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
