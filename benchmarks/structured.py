#!/usr/bin/env python
"""Structured-output benchmark: what a grammar costs a batch, and what a compile costs.

Two parts:

1. **Throughput.** One mlxd daemon (``python -m mlxd serve``, batch wide enough
   for C) serves waves of C concurrent chat requests, greedy, ``max_tokens``
   each. Waves alternate free and ``json_schema``-constrained (every row of the
   wave), in the same session, so both see the same machine state. The schema
   asks for a long array of objects, so constrained rows run to ``max_tokens``
   like the free ones and both waves generate the same number of tokens.
   ``tps`` = completion tokens of the wave / wall seconds of the wave.
2. **Compile time.** The grammar of each test schema (tests/support/schemas.py)
   compiled with the model's llguidance tokenizer: ``cold`` (first compile),
   ``cached`` (a copy from mlxd's LRU). Also the tokenizer build (once per model).

Usage: ``python benchmarks/structured.py [--model DIR|demo] [--concurrency 8]
[--max-tokens 128] [--waves 3]``. A Markdown summary goes to stdout, JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "note": {"type": "string", "maxLength": 120},
                    "score": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "required": ["name", "note", "score"],
                "additionalProperties": False,
            },
            "minItems": 30,
            "maxItems": 60,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


def wave(url: str, c: int, max_tokens: int, constrained: bool, tag: int) -> dict[str, Any]:
    import httpx

    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG_SCHEMA}}
    tokens = [0] * c
    finish: list[str | None] = [None] * c

    def one(i: int) -> None:
        body: dict[str, Any] = {
            "model": "bench",
            "messages": [
                {"role": "user", "content": f"List {tag}-{i}: cities and what they are known for."}
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if constrained:
            body["response_format"] = fmt
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        data = r.json()
        tokens[i] = data["usage"]["completion_tokens"]
        finish[i] = data["choices"][0]["finish_reason"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(c)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {
        "constrained": constrained,
        "tokens": sum(tokens),
        "wall_s": wall,
        "tps": sum(tokens) / wall,
        "finish": finish,
    }


def throughput(args: argparse.Namespace, model_dir: str, workdir: Path) -> dict[str, Any]:
    import tomli_w
    from servebench.processes import Server, free_port

    port = free_port()
    config = workdir / "mlxd.toml"
    config.write_text(
        tomli_w.dumps(
            {
                "server": {"log_level": "warning"},
                "model": {"path": model_dir, "name": "bench"},
                "batch": {"size": args.concurrency, "kv_budget": "16GiB"},
                "prompt_cache": {"max_entries": 0},
            }
        )
    )
    cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(config), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with Server("mlxd", cmd, dict(os.environ), f"{url}/ready", workdir / "mlxd.log"):
        wave(url, args.concurrency, 8, False, -1)  # warm-up, both paths
        wave(url, args.concurrency, 8, True, -2)
        waves = []
        for n in range(args.waves):
            for constrained in (False, True):
                w = wave(url, args.concurrency, args.max_tokens, constrained, n)
                print(
                    f"wave {n} {'json' if constrained else 'free'}: {w['tokens']} tokens "
                    f"in {w['wall_s']:.2f}s = {w['tps']:.1f} tok/s",
                    file=sys.stderr,
                )
                waves.append(w)
    free = statistics.median(w["tps"] for w in waves if not w["constrained"])
    json_tps = statistics.median(w["tps"] for w in waves if w["constrained"])
    # Each json wave against the free wave just before it: on a machine with
    # other load, adjacent waves see the most similar conditions.
    pairs = [b["tps"] / a["tps"] for a, b in zip(waves[::2], waves[1::2], strict=True)]
    return {
        "waves": waves,
        "free_tps": free,
        "json_tps": json_tps,
        "ratio": json_tps / free,
        "pair_ratios": pairs,
        "pair_ratio_median": statistics.median(pairs),
    }


def compile_times(model_dir: str) -> dict[str, Any]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.engine.chat.grammar import Grammars, make_ll_tokenizer
    from mlxd.engine.constraints import json_constraint
    from tests.support.schemas import JSON_SCHEMAS

    tok = load_tokenizer(Path(model_dir))
    started = time.perf_counter()
    ll = make_ll_tokenizer(tok, len(tok))
    build = time.perf_counter() - started
    grammars = Grammars(ll, len(tok))
    cold, cached = [], []
    for _ in range(5):
        grammars = Grammars(ll, len(tok))  # an empty LRU: every first compile is cold
        for schema in JSON_SCHEMAS.values():
            c = json_constraint(schema, strict=True, param="bench")
            seconds, hit = grammars.warm(c)
            assert not hit
            cold.append(seconds)
            for _ in range(3):
                seconds, hit = grammars.warm(c)
                assert hit
                cached.append(seconds)
    mask = mask_times(tok, ll, len(tok))
    ms = 1000.0
    return {
        **mask,
        "schemas": len(JSON_SCHEMAS),
        "tokenizer_build_s": build,
        "cold_p50_ms": percentile(cold, 0.5) * ms,
        "cold_p95_ms": percentile(cold, 0.95) * ms,
        "cached_p50_ms": percentile(cached, 0.5) * ms,
        "cached_p95_ms": percentile(cached, 0.95) * ms,
    }


def mask_times(tok: Any, ll: Any, width: int, steps: int = 300) -> dict[str, float]:
    """Per-token cost of a row's grammar processor: feed the sampled token,
    compute the next mask, apply it to ``(1, width)`` logits (portable path on
    Linux), evaluated. A seeded random walk through the allowed tokens."""
    import mlx.core as mx
    import numpy as np

    from mlxd.engine.chat.grammar import ConstraintProcessor, Grammars
    from mlxd.engine.constraints import json_constraint

    grammars = Grammars(ll, width)
    c = json_constraint(LONG_SCHEMA, strict=True, param="bench")
    proc = ConstraintProcessor(grammars.matcher(c))
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(1, width)).astype(np.float32))
    context = [1, 2, 3]
    times = []
    eos = set(tok.eos_token_ids)
    for _ in range(steps):
        started = time.perf_counter()
        out = proc(mx.array(context), logits)
        mx.eval(out)
        times.append(time.perf_counter() - started)
        allowed = [
            int(t) for t in np.nonzero(np.isfinite(np.array(out[0])))[0] if int(t) not in eos
        ]
        if not allowed:
            break
        context.append(int(rng.choice(allowed)))
    us = 1e6
    return {
        "mask_tokens": len(times),
        "mask_p50_us": percentile(times, 0.5) * us,
        "mask_p95_us": percentile(times, 0.95) * us,
    }


def resolve_model(name: str) -> str:
    """A model directory; ``demo`` prepares the demo model as ``mlxd demo-model`` does."""
    if name != "demo":
        return str(Path(name).expanduser().resolve())
    out = subprocess.run(
        [sys.executable, "-m", "mlxd", "demo-model"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"mlxd demo-model failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--compile-only", action="store_true", help="skip the throughput part")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model)
    comp = compile_times(model_dir)
    if args.compile_only:
        print(json.dumps(comp, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-structured-") as tmp:
        tput = throughput(args, model_dir, Path(tmp))
    report = {"model": model_dir, "settings": vars(args) | {"out": str(args.out)}}
    report |= {"throughput": tput, "compile": comp}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print("| C | max_tokens | free tok/s | json_schema tok/s | ratio | median pair ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| {args.concurrency} | {args.max_tokens} | {tput['free_tps']:.1f} | "
        f"{tput['json_tps']:.1f} | {tput['ratio']:.2f} | {tput['pair_ratio_median']:.2f} |"
    )
    print()
    print(
        "| schemas | tokenizer build | cold p50 | cold p95 | cached p50 | cached p95 "
        "| mask+apply p50 | mask+apply p95 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {comp['schemas']} | {comp['tokenizer_build_s'] * 1000:.0f} ms | "
        f"{comp['cold_p50_ms']:.2f} ms | {comp['cold_p95_ms']:.2f} ms | "
        f"{comp['cached_p50_ms']:.3f} ms | {comp['cached_p95_ms']:.3f} ms | "
        f"{comp['mask_p50_us']:.0f} µs | {comp['mask_p95_us']:.0f} µs |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
