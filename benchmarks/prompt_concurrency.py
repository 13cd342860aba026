#!/usr/bin/env python
"""Which ``[batch] prompt_concurrency`` serves a burst best? mlxd against itself.

For each prompt concurrency P (default 1, 4, 8, 16) this starts mlxd with
``[batch] size`` = the largest C and ``prompt_concurrency = P``, serves a
discarded warm-up wave, then one wave of C concurrent streaming clients per C
(default 1, 4, 8, 16), exactly as ``benchmarks/serving.py`` drives mlxd (same
prompts, greedy, prompt cache off). The configurations run back to back in one
process, in a rotating order over ``--repeats`` rounds, so on a shared machine
they see the same background load; compare them with each other, not with
numbers from another day. Prints one Markdown table (e2e tok/s, TTFT and ITL
p50/p95 per P and C, medians over rounds) and writes JSON to ``--out``.

Usage: ``python benchmarks/prompt_concurrency.py [--model DIR|demo] [--values 1,4,8,16]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servebench.processes import resolve_model  # noqa: E402
from servebench.summary import median_of  # noqa: E402
from servebench.systems import run_mlxd  # noqa: E402
from serving import parse_args as serving_args  # noqa: E402

logger = logging.getLogger("bench")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", type=_ints, default=[1, 4, 8, 16], help="prompt concurrencies P")
    p.add_argument("--repeats", type=int, default=2, help="rounds (medians over them)")
    p.add_argument("--out", type=Path, default=None, help="JSON output path")
    own, rest = p.parse_known_args(argv)
    # Everything else (--model, --concurrency, --max-tokens, ...) as serving.py takes it.
    bench = serving_args(rest)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    own.out = own.out or ROOT / "benchmarks" / "results" / f"prompt-concurrency-{stamp}.json"
    return own, bench


def _cell(m: dict[str, Any], key: str, fmt: str = "{:.0f}") -> str:
    value = m.get(key)
    return "-" if value is None else fmt.format(value)


def table(results: dict[int, dict[int, dict[str, Any]]], cs: list[int]) -> str:
    lines = [
        "| P | C | e2e tok/s | decode tok/s | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | "
        "others' CPU | rounds |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in cs:
        for p, per_c in results.items():
            m = per_c[c]
            lines.append(
                f"| {p} | {c} | {_cell(m, 'e2e_tps', '{:.1f}')} | "
                f"{_cell(m, 'decode_tps', '{:.1f}')} | "
                f"{_cell(m, 'ttft_p50_ms')} / {_cell(m, 'ttft_p95_ms')} | "
                f"{_cell(m, 'itl_p50_ms')} / {_cell(m, 'itl_p95_ms')} | "
                f"{_cell(m, 'background_cores', '{:.2f}')} | {m.get('rounds_used', '-')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    own, args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level="INFO", format="%(asctime)s bench: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    runs: dict[int, dict[int, list[dict[str, Any]]]] = {
        p: {c: [] for c in args.concurrency} for p in own.values
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mlxd-pc-") as tmp:
        workdir = Path(tmp)
        model_dir, dtype = resolve_model(args, workdir)
        logger.info("model: %s (%s)", model_dir, dtype)
        for r in range(own.repeats):
            k = r % len(own.values)
            for p in own.values[k:] + own.values[:k]:
                logger.info("round %d/%d: prompt_concurrency %d", r + 1, own.repeats, p)
                args.prompt_concurrency = p
                measured = run_mlxd(args, model_dir, workdir)
                for c in args.concurrency:
                    runs[p][c].append(measured.summaries[c])
    medians = {
        p: {c: median_of(rs, args.max_background) for c, rs in per_c.items()}
        for p, per_c in runs.items()
    }
    report = {
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/prompt_concurrency.py", *(argv or sys.argv[1:])]),
        "model": model_dir,
        "dtype": dtype,
        "values": own.values,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "repeats": own.repeats,
        "runs": {str(p): {str(c): rs for c, rs in per_c.items()} for p, per_c in runs.items()},
        "elapsed_s": time.monotonic() - started,
    }
    own.out.parent.mkdir(parents=True, exist_ok=True)
    own.out.write_text(json.dumps(report, indent=1))
    print(f"model {model_dir} ({dtype}), max_tokens {args.max_tokens}, batch size "
          f"{args.batch_size}, {own.repeats} rounds, greedy, prompt cache off\n")  # fmt: skip
    print(table(medians, args.concurrency))
    logger.info("wrote %s in %.0f s", own.out, report["elapsed_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
