#!/usr/bin/env python
"""MTP drafting, rows one by one against rows together: the time of the drafting alone.

``mode = "mtp"`` drafts every row of a verify step from its MTP head before the
verify forward. Row by row (``MtpDrafter.propose``, what mlxd did first) that is
``rows x depth`` small head forwards; together (``MtpDrafter.propose_rows``) it is
``depth`` forwards over all rows. This times both in one process, alternating, on
a random-weight DeepSeek-V3 MTP layer (``deepseek_v3``: MLA attention, MoE) built
from mlx-lm's own classes: no checkpoint, no target forward, no HTTP; with the
BLAS the daemon would use (re-executed with it preloaded, as ``mlxd serve`` is).

Each round, every row's drafter state is as after a verify step that kept
``--took`` drafted tokens (``took + 1`` pairs to feed) with ``--context`` head
positions cached; the rows then draft ``--depth`` tokens. The table gives the
median milliseconds per drafting step and the ratio.

``--prefill LAYERS`` times the other cost instead: an MTP lane's prefill
feeding the prompt's hidden states to the head (:mod:`mlxd.engine.chat.speculative.mtp_prefill`)
against a plain prefill, two ``--prompt``-token prompts together through mlx-lm's
``BatchGenerator`` (chunks of 128) on a ``LAYERS``-layer random DeepSeek-V3, until
both rows have their first token.

Usage: ``python benchmarks/mtp_drafting.py [--rows 1,8] [--depth 3] [--hidden 512]
[--vocab 32000] [--rounds 20] [--prefill LAYERS [--prompt 512]]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxd.runtime.blas import ensure_blas  # noqa: E402

ensure_blas("auto", None, sys.argv)  # the daemon's BLAS (Linux: a system OpenBLAS), as it runs

import mlx.core as mx  # noqa: E402


def head(hidden: int, vocab: int, layers: int = 1):
    """An MtpHead over a random DeepSeek-V3 of ``layers`` decoder layers."""
    from mlx_lm.models import deepseek_v3

    from mlxd.engine.chat.speculative.mtp_head import MtpHead, nextn_module, target_parts

    args = deepseek_v3.ModelArgs.from_dict(
        {
            "model_type": "deepseek_v3",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden // 2,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "n_shared_experts": 1,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "first_k_dense_replace": 0,
            "kv_lora_rank": hidden // 4,
            "q_lora_rank": hidden // 2,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
        }
    )
    model = deepseek_v3.Model(args)
    module = nextn_module(model)
    mx.eval(model.parameters(), module.parameters())
    trunk, out, embed = target_parts(model)
    return MtpHead(module, trunk, out, embed, "deepseek_v3", 0), model


def observe(drafter, uids, tokens, pending, took, size, key):
    """Every row as after a verify step that kept ``took`` drafted tokens."""
    drafter._hidden = mx.random.normal((len(uids), took + 1, size), key=key)
    for u in uids:
        tokens[u].extend([5] * (took + 1))
    batch = SimpleNamespace(
        uids=uids, tokens=[tokens[u] for u in uids], _next_tokens=mx.array([pending] * len(uids))
    )
    drafter.observe(batch, uids, [[5] * took for _ in uids], [took] * len(uids))


def run(rows: int, args: argparse.Namespace, mtp_head, size: int) -> tuple[float, float]:
    from mlxd.engine.chat.speculative.mtp import MtpDrafter

    drafters = {"alone": MtpDrafter(mtp_head), "together": MtpDrafter(mtp_head)}
    tokens = {name: {u: [1, 2, 3] for u in range(rows)} for name in drafters}
    uids = list(range(rows))
    times: dict[str, list[float]] = {name: [] for name in drafters}
    warm = max(1, args.context // (args.took + 1))
    for step in range(warm + args.rounds):
        key = mx.random.key(step)
        for name, drafter in drafters.items():
            observe(drafter, uids, tokens[name], 7, args.took, size, key)
            asks = [(u, tokens[name][u], 7, args.depth) for u in uids]
            started = time.perf_counter()
            if name == "alone":
                for ask in asks:
                    drafter.propose(*ask)
            else:
                drafter.propose_rows(asks)
            if step >= warm:
                times[name].append(time.perf_counter() - started)
    return statistics.median(times["alone"]), statistics.median(times["together"])


def prefill(args: argparse.Namespace) -> None:
    """Two prompts prefilled together (chunks of 128), the MTP feed off and on, alternating."""
    from mlx_lm.generate import BatchGenerator

    from mlxd.engine.chat.speculative.mtp import MtpDrafter
    from mlxd.engine.chat.speculative.mtp_prefill import feed_prefill

    mtp_head, model = head(args.hidden, args.vocab, args.prefill)
    prompts = [[(7 * i + r) % args.vocab for i in range(args.prompt)] for r in range(2)]
    times: dict[str, list[float]] = {"off": [], "fed": []}
    feeding: list[float] = []  # the head's share: MtpDrafter.prefilled
    for step in range(1 + args.rounds):
        for name in times:
            gen = BatchGenerator(model, prefill_batch_size=2, prefill_step_size=128)
            spent = [0.0]
            if name == "fed":
                drafter = MtpDrafter(mtp_head)
                feed = drafter.prefilled

                def timed(*a: Any, feed: Any = feed, spent: list[float] = spent) -> None:
                    began = time.perf_counter()
                    feed(*a)
                    spent[0] += time.perf_counter() - began

                drafter.prefilled = timed  # type: ignore[method-assign]
                feed_prefill(gen._prompt_batch, drafter, lambda: True)
            gen.insert(prompts, max_tokens=[4, 4])
            started = time.perf_counter()
            while len(gen._generation_batch) < 2:
                gen.next()
            mx.eval(gen._generation_batch._next_tokens)
            if step:
                times[name].append(time.perf_counter() - started)
                if name == "fed":
                    feeding.append(spent[0])
            gen.close()
    off, fed = statistics.median(times["off"]), statistics.median(times["fed"])
    head_ms = statistics.median(feeding) * 1e3
    print(
        f"prefill of 2 x {args.prompt} tokens, {args.prefill} decoder layers, hidden {args.hidden}:"
    )
    print("| feed off ms | feed on ms | on vs off | feeding the head ms | each round off/on |")
    print("| --- | --- | --- | --- | --- |")
    rounds = " ".join(
        f"{a * 1e3:.0f}/{b * 1e3:.0f}" for a, b in zip(times["off"], times["fed"], strict=True)
    )
    print(f"| {off * 1e3:.0f} | {fed * 1e3:.0f} | {fed / off:.3f}x | {head_ms:.0f} | {rounds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--took", type=int, default=1, help="accepted drafts per step")
    parser.add_argument("--context", type=int, default=64, help="head positions cached")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--prefill", type=int, default=0, help="LAYERS: time the prompt feed instead"
    )
    parser.add_argument("--prompt", type=int, default=512, help="--prefill: prompt tokens")
    args = parser.parse_args()
    if args.prefill:
        prefill(args)
        return
    mtp_head, _ = head(args.hidden, args.vocab)
    size = args.hidden
    print(
        f"device {mx.default_device()}, hidden {args.hidden}, vocab {args.vocab}, "
        f"depth {args.depth}, {args.took + 1} pairs a row, ~{args.context} head positions"
    )
    print("| rows | one by one ms/step | together ms/step | together vs one by one |")
    print("| --- | --- | --- | --- |")
    for rows in [int(r) for r in args.rows.split(",")]:
        alone, together = run(rows, args, mtp_head, size)
        print(f"| {rows} | {alone * 1e3:.1f} | {together * 1e3:.1f} | {alone / together:.2f}x |")


if __name__ == "__main__":
    main()
