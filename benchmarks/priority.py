#!/usr/bin/env python
"""Who goes first, measured: an interactive client among bulk streaming clients.

One run starts mlxd once per scheduling mode and drives the same mixed load
against each, back to back (in a rotating order over ``--repeats`` rounds, so
the modes share the machine's background load):

- **fifo**: no API keys; every request is equal (mlxd before issue 23);
- **priority**: the interactive client's key is ``high``, the bulk clients'
  key ``low`` (``[scheduling] preempt = false``): the interactive request goes
  first when a row frees up;
- **preempt**: the same keys with ``preempt = true``: a bulk row yields at once.

The load: ``--bulk`` streaming clients, each sending ``--bulk-tokens`` long
requests back to back for ``--seconds``, and one interactive client sending a
``--interactive-tokens`` request every ``--every`` seconds. With
``[batch] size`` = ``--batch-size`` < the bulk clients, every row is always
taken, the case priority is for. Reported per mode: the interactive client's
TTFT p50/p95, its requests, the whole load's throughput (streamed tokens per
second over the window) and the preemptions. Prints a Markdown table and
writes JSON to ``--out``.

Usage: ``python benchmarks/priority.py [--model DIR|demo] [--seconds 30] [--bulk 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from servebench.processes import Server, free_port, resolve_model  # noqa: E402

logger = logging.getLogger("bench")
MODES = ("fifo", "priority", "preempt")
KEYS = {"interactive": "sk-bench-interactive", "bulk": "sk-bench-bulk"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="an mlx-lm model directory, or demo")
    p.add_argument("--demo-dtype", default="auto")
    p.add_argument("--blas", default="auto")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--bulk", type=int, default=4, help="bulk streaming clients")
    p.add_argument("--bulk-tokens", type=int, default=128)
    p.add_argument("--interactive-tokens", type=int, default=16)
    p.add_argument("--every", type=float, default=1.0, help="seconds between interactive requests")
    p.add_argument(
        "--seconds", type=float, default=None, help="measured window per mode (default 30)"
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--quick", action="store_true", help="smoke test: 4 s windows (or --seconds)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.quick:
        args.seconds, args.bulk_tokens, args.every = args.seconds or 4.0, 32, 0.5
    args.seconds = args.seconds or 30.0
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"priority-{stamp}.json"
    return args


def config(args: argparse.Namespace, model_dir: str, mode: str) -> str:
    lines = [
        "[model]",
        f'path = "{model_dir}"',
        'name = "bench"',
        "[batch]",
        f"size = {args.batch_size}",
        "[runtime]",
        f'blas = "{args.blas}"',
        "[sampling]",
        "temperature = 0.0",
    ]
    if mode != "fifo":
        lines += ["[scheduling]", f"preempt = {'true' if mode == 'preempt' else 'false'}"]
        lines += [
            "[keys.interactive]",
            f'key = "{KEYS["interactive"]}"',
            'priority = "high"',
            "[keys.bulk]",
            f'key = "{KEYS["bulk"]}"',
            'priority = "low"',
        ]
    return "\n".join(lines) + "\n"


async def stream_one(
    client: httpx.AsyncClient, key: str, prompt: str, max_tokens: int, counts: dict[str, Any]
) -> float | None:
    """One streamed completion; returns its TTFT (s). Every chunk counts as a token."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    started, ttft = time.perf_counter(), None
    async with client.stream(
        "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status_code != 200:
            counts["errors"] += 1
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            if counts["open"]:
                counts["tokens"] += 1
    return ttft


async def drive(args: argparse.Namespace, url: str) -> dict[str, Any]:
    counts: dict[str, Any] = {"tokens": 0, "errors": 0, "open": False}
    ttfts: list[float] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.bulk + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def bulk(i: int) -> None:
            n = 0
            while not stop.is_set():
                prompt = f"Write a long story about lighthouse number {i}-{n}."
                await stream_one(client, KEYS["bulk"], prompt, args.bulk_tokens, counts)
                n += 1

        async def interactive() -> None:
            n = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                prompt = f"Quick question {n}: what is the capital of France?"
                ttft = await stream_one(
                    client, KEYS["interactive"], prompt, args.interactive_tokens, counts
                )
                if ttft is not None and counts["open"]:
                    ttfts.append(ttft)
                n += 1
                await asyncio.sleep(max(0.0, args.every - (time.perf_counter() - t0)))

        tasks = [asyncio.create_task(bulk(i)) for i in range(args.bulk)]
        await asyncio.sleep(min(5.0, args.seconds / 3))  # every row taken before measuring
        tasks.append(asyncio.create_task(interactive()))
        counts["open"] = True
        began = time.perf_counter()
        await asyncio.sleep(args.seconds)
        counts["open"] = False
        window = time.perf_counter() - began
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ttfts.sort()
    return {
        "interactive_requests": len(ttfts),
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "ttft_p95_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None,
        "tokens_per_s": counts["tokens"] / window,
        "errors": counts["errors"],
    }


def run_mode(args: argparse.Namespace, model_dir: str, mode: str, workdir: Path) -> dict[str, Any]:
    port = free_port()
    cfg = workdir / f"{mode}.toml"
    cfg.write_text(config(args, model_dir, mode))
    cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(cfg), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    env = {**__import__("os").environ, "MLXD_SERVER__STATE_DIR": str(workdir / f"state-{mode}")}
    logger.info("mode %s: starting mlxd", mode)
    with Server(f"mlxd-{mode}", cmd, env, f"{url}/ready", workdir / f"{mode}.log", f"{url}/stats"):
        result = asyncio.run(drive(args, url))
        stats = httpx.get(f"{url}/stats", timeout=10).json()
    result["preemptions"] = stats["counters"].get("preemptions", 0)
    logger.info("mode %s: %s", mode, result)
    return result


def _cell(value: Any, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| mode | interactive TTFT p50 / p95 (ms) | interactive requests | "
        "throughput (tok/s, all clients) | vs fifo | preemptions |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = results.get("fifo", {}).get("tokens_per_s")
    for mode, m in results.items():
        ratio = f"{100 * m['tokens_per_s'] / base:.0f}%" if base else "-"
        lines.append(
            f"| {mode} | {_cell(m['ttft_p50_ms'])} / {_cell(m['ttft_p95_ms'])} | "
            f"{m['interactive_requests']} | {m['tokens_per_s']:.1f} | {ratio} | "
            f"{m['preemptions']} |"
        )
    return "\n".join(lines)


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxd-priority-") as tmp:
        workdir = Path(tmp)
        model_dir, dtype = resolve_model(args, workdir)
        per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
        for r in range(args.repeats):
            order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
            for mode in order:
                per_mode[mode].append(run_mode(args, model_dir, mode, workdir))
    results = {m: _median(rounds) for m, rounds in per_mode.items()}
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"path": model_dir, "dtype": dtype},
        "results": results,
        "rounds": per_mode,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"model {Path(model_dir).name} ({dtype}), batch size {args.batch_size}, "
        f"{args.bulk} bulk clients x {args.bulk_tokens} tokens, one interactive client "
        f"({args.interactive_tokens} tokens every {args.every}s), {args.seconds:.0f}s per mode, "
        f"{args.repeats} round(s)\n"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
