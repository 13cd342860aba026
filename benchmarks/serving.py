#!/usr/bin/env python
"""Serving benchmark: mlxd against its ceiling and against ``mlx_lm.server``.

For each concurrency C (1, 4, 8, 16 by default) this drives C concurrent
streaming chat clients with fixed, distinct prompts and ``max_tokens``, greedy
decoding, against:

- **mlxd**, started as users start it (``python -m mlxd serve``, including its
  BLAS re-exec), one batch wide enough for the largest C, prompt cache off;
- **the ceiling**: mlx-lm's ``batch_generate`` on the same token ids (the chat
  template applied as mlxd applies it), B = C, no server, in its own process
  with the BLAS mlxd ended up with;
- optionally (``--mlx-lm-server``) **mlx_lm.server** with the same model, the
  same widths and the same BLAS environment, driven by the same client code.

The three never run at the same time. Definitions of every number are in
benchmarks/README.md; in short, per wave of C streams started together at t0:

- ``tokens``: completion tokens as each system counts them (the final EOS
  included when a stream stops on it), summed over the streams;
- ``e2e_tps``: tokens / (last stream end - t0), prefill included;
- ``decode_tps``: sum of (tokens - 1) / (last stream end - earliest first token);
- TTFT: first token - request sent; ITL: gaps between a stream's consecutive
  text chunks (consecutive tokens for the ceiling), pooled over the streams;
- peak KV bytes: the most ``/stats`` ``batch.kv_bytes`` seen while polling
  (the ceiling reports ``BatchGenerator.prompt_cache_nbytes`` after each step).

``--repeats`` rounds each start every system afresh, serve a discarded warm-up
wave and then one wave per C; every metric is the median over the rounds.
Results: a Markdown table on stdout, JSON in ``--out``. Progress goes to stderr.

Usage: ``python benchmarks/serving.py [--model DIR|demo] [--mlx-lm-server] [--quick]``;
``python benchmarks/serving.py --report FILE [CORES]`` prints a saved run's tables again.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servebench.ceiling import ceiling_worker  # noqa: E402
from servebench.cpu import cpu_busy, wait_for_idle  # noqa: E402
from servebench.processes import blas_env, resolve_model  # noqa: E402
from servebench.report import environment, markdown  # noqa: E402
from servebench.summary import with_medians  # noqa: E402
from servebench.systems import Measured, run_ceiling, run_mlx_lm_server, run_mlxd  # noqa: E402

logger = logging.getLogger("bench")


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers such as 1,4,8,16")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="an mlx-lm model directory, or 'demo' (default)")
    p.add_argument("--demo-dtype", default="auto", choices=["auto", "q4", "float32", "bfloat16"])
    p.add_argument(
        "--concurrency", type=_int_list, default=None, help="C values (default 1,4,8,16)"
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="mlxd [batch] size (default: max C)"
    )
    p.add_argument("--prompt-concurrency", type=int, default=8)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="waves per C; metrics are medians")
    p.add_argument("--mlx-lm-server", action="store_true", help="also benchmark mlx_lm.server")
    p.add_argument("--blas", default="auto", choices=["auto", "off"], help="mlxd [runtime] blas")
    p.add_argument(
        "--stats-interval", type=float, default=0.25, help="seconds between /stats polls"
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="before each system's round, wait (up to 10 min) until the machine is at most "
        "this busy, e.g. 0.2 on a shared machine (default 1: never wait)",
    )
    p.add_argument(
        "--max-background",
        type=float,
        default=0.2,
        metavar="CORES",
        help="leave out of the medians the rounds whose wave ran while other processes used "
        "more than this many cores (if one round remains); default 0.2",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke test: C=1,4, 16 tokens, 0.25 s load readings"
    )
    p.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or ([1, 4] if args.quick else [1, 4, 8, 16])
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.batch_size = args.batch_size or max(args.concurrency)
    if args.batch_size < max(args.concurrency):
        p.error("--batch-size must be at least the largest C (every wave fits one batch)")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"serving-{stamp}.json"
    return args


def run_rounds(
    args: argparse.Namespace, model_dir: str, workdir: Path, env: dict[str, Any]
) -> dict[str, list[Measured]]:
    """``repeats`` rounds; each starts every system afresh and runs every C once.

    Rounds rotate the order of the systems, so slow drifts in the machine's
    background load spread over all of them. mlxd goes first in round one:
    the others copy the BLAS environment it ended up with.
    """
    systems = ["mlxd", "ceiling"] + (["mlx_lm_server"] if args.mlx_lm_server else [])
    rounds: dict[str, list[Measured]] = {name: [] for name in systems}
    other_env: dict[str, str] = {}
    env["rounds"] = []
    for r in range(args.repeats):
        for name in systems[r % len(systems) :] + systems[: r % len(systems)]:
            logger.info("round %d/%d: %s", r + 1, args.repeats, name)
            # --quick proves the script runs: a short reading of the machine's load will do.
            sample = 0.25 if args.quick else 2.0
            busy = wait_for_idle(args.wait_idle) if args.wait_idle < 1 else cpu_busy(sample)
            load, began = os.getloadavg()[0], time.monotonic()
            if name == "mlxd":
                measured = run_mlxd(args, model_dir, workdir)
                if r == 0:
                    env["mlxd_runtime"] = measured.info
                    other_env = blas_env(measured.info)
                    env["ld_preload"] = other_env.get("LD_PRELOAD")
                    env["openblas_num_threads"] = other_env.get("OPENBLAS_NUM_THREADS")
            elif name == "ceiling":
                measured = run_ceiling(args, model_dir, other_env, workdir)
                env["ceiling_runtime"] = measured.info
            else:
                measured = run_mlx_lm_server(args, model_dir, other_env, workdir)
                env["mlx_lm_server"] = measured.info
            rounds[name].append(measured)
            env["rounds"].append(
                {"round": r + 1, "system": name, "seconds": round(time.monotonic() - began, 1),
                 "cpu_busy_before": busy, "loadavg_1min_before": load,
                "loadavg_1min_after": os.getloadavg()[0]}
            )  # fmt: skip
    return rounds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ceiling-worker"]:
        ceiling_worker(argv[1], argv[2])
        return 0
    if argv[:1] == ["--report"]:  # re-render a saved run (medians recomputed)
        report = json.loads(Path(argv[1]).read_text())
        limit = report["settings"].get("max_background")
        with_medians(report["results"], float(argv[2]) if argv[2:] else limit)
        print(markdown(report))
        return 0
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the servers started so far are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level="INFO", format="%(asctime)s bench: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        workdir = Path(tmp)
        model_dir, dtype = resolve_model(args, workdir)
        logger.info("model: %s (%s)", model_dir, dtype)
        env = environment(model_dir, dtype)
        try:
            rounds = run_rounds(args, model_dir, workdir, env)
        except Exception:
            for log in workdir.glob("*.log"):
                sys.stderr.write(
                    f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}\n"
                )
            raise
    results = {
        name: {
            str(c): {"runs": [m.summaries[c] for m in measured], "texts": measured[-1].texts[c]}
            for c in args.concurrency
        }
        for name, measured in rounds.items()
    }
    with_medians(results, args.max_background)
    report = {
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "benchmarks/serving.py", *argv]),
        "settings": {
            k: getattr(args, k)
            for k in (
                "model",
                "demo_dtype",
                "concurrency",
                "max_tokens",
                "batch_size",
                "prompt_concurrency",
                "prefill_step_size",
                "repeats",
                "blas",
                "stats_interval",
                "wait_idle",
                "max_background",
                "quick",
            )
        },
        "environment": env,
        "results": results,
        "elapsed_s": time.monotonic() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    logger.info("wrote %s in %.0f s", args.out, report["elapsed_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
