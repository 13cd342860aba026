#!/usr/bin/env python
"""Quantized KV (``[batch] kv_bits``): peak memory of long prefills, and answer quality.

``peak``: for prompts of 4k, 16k and 32k tokens, prefill one sequence in
``--step``-token chunks (the engine's ``prefill_step_size``) into

- a full-precision ``KVCache`` (``kv_bits = 0``),
- mlxd's quantized cache (``mlxd.engine.chat.quant_cache``) at 8 and 4 bits,
- mlx-lm's stock ``QuantizedKVCache`` at 8 bits (its quantized attention on
  every chunk: the path whose peak rose above full precision on Metal,
  mlx-lm #1587), for comparison,

and report MLX's peak memory above the weights (``mx.get_peak_memory`` after
``mx.reset_peak_memory``, so activations and transient copies count, not only
the cache) and the bytes the cache holds. Default model: the tiny 64-wide-head
llama of the tests (``llama_kvq``), or ``--model DIR``.

``quality``: greedy decoding with and without quantized KV on a fixed set of
prompts, on the demo model by default. The full-precision greedy tokens are
the reference; each quantized run is teacher-forced along them (one token at
a time, so decode attends quantized), giving the share of positions whose
greedy token agrees and the mean absolute difference of the reference
token's logprob.

Usage: ``python benchmarks/kv_quant.py peak [--lengths 4096,16384,32768]
[--step 512] [--model DIR] [--kinds full,q8,q4,stock8]`` and ``python benchmarks/kv_quant.py quality
[--model DIR] [--tokens 32]``. Markdown to stdout. On Linux, preload OpenBLAS
(docs/performance.md) or the reference BLAS makes the long prefills slow.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.chat.quant_cache import fresh_cache

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
]


def _cache(model: Any, kind: str) -> list[Any]:
    if kind == "full":
        return make_prompt_cache(model)
    if kind == "stock8":
        return [QuantizedKVCache(64, 8) for _ in make_prompt_cache(model)]
    return fresh_cache(model, (int(kind[1:]), 64))


def _tiny() -> Path:
    from tests.support.tinymodels import KV_QUANT_FAMILY, tiny_model_dir

    return tiny_model_dir(KV_QUANT_FAMILY)


def peak(args: argparse.Namespace) -> None:
    model, _ = load(str(args.model or _tiny()))
    vocab = model.args.vocab_size
    kinds = args.kinds
    print(f"| prompt tokens | {' | '.join(kinds)} |  (peak MiB above weights / KV MiB held)")
    print(f"| --- | {' | '.join('---' for _ in kinds)} |")
    for n in args.lengths:
        ids = mx.array([[(7 * k) % (vocab - 10) + 5 for k in range(n)]])
        cells = []
        for kind in kinds:
            cache = _cache(model, kind)
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            started = time.perf_counter()
            for i in range(0, n, args.step):
                model(ids[:, i : i + args.step], cache=cache)
                mx.eval([c.state for c in cache])
            held = sum(c.nbytes for c in cache)
            top = mx.get_peak_memory() - base
            took = time.perf_counter() - started
            cells.append(f"{top / 2**20:.0f} / {held / 2**20:.0f}")
            print(f"  {n} {kind}: {took:.1f}s, {cells[-1]} MiB", file=sys.stderr, flush=True)
            del cache
        print(f"| {n} | {' | '.join(cells)} |", flush=True)


def _forced(model: Any, prompt: list[int], tokens: list[int], kind: str) -> list[tuple[int, float]]:
    """(greedy token, logprob of the reference token) at each reference position."""
    cache = _cache(model, kind)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out = []
    for t in tokens:
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.append((int(mx.argmax(lp, axis=-1).item()), float(lp[0, t].item())))
        logits = model(mx.array([[t]]), cache=cache)[:, -1]
    return out


def quality(args: argparse.Namespace) -> None:
    if args.model is None:
        from mlxd.demo import prepare_demo_model

        args.model = prepare_demo_model("float32")
    model, tokenizer = load(str(args.model))
    rows = {"q8": [0, 0, 0.0], "q4": [0, 0, 0.0]}
    for text in PROMPTS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        ref = []
        cache = _cache(model, "full")
        logits = model(mx.array([prompt]), cache=cache)[:, -1]
        for _ in range(args.tokens):
            t = int(mx.argmax(logits, axis=-1).item())
            ref.append(t)
            logits = model(mx.array([[t]]), cache=cache)[:, -1]
        base = _forced(model, prompt, ref, "full")
        for kind, acc in rows.items():
            got = _forced(model, prompt, ref, kind)
            acc[0] += sum(g == r for (g, _), r in zip(got, ref, strict=True))
            acc[1] += len(ref)
            acc[2] += sum(abs(a - b) for (_, a), (_, b) in zip(got, base, strict=True))
        print(f"  {text!r}: {tokenizer.decode(ref)!r}", file=sys.stderr)
    print("| kv_bits | greedy agreement | mean abs logprob diff |")
    print("| --- | --- | --- |")
    for kind, (same, total, diff) in rows.items():
        print(f"| {kind[1:]} | {same / total:.1%} ({same}/{total}) | {diff / total:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("peak")
    p.add_argument("--lengths", default="4096,16384,32768")
    p.add_argument("--step", type=int, default=512)
    p.add_argument("--model", type=Path)
    p.add_argument("--kinds", default="full,q8,q4,stock8", help="full, q8, q4, stock8")
    q = sub.add_parser("quality")
    q.add_argument("--model", type=Path)
    q.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    if args.what == "peak":
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.kinds = args.kinds.split(",")
        peak(args)
    else:
        quality(args)


if __name__ == "__main__":
    main()
