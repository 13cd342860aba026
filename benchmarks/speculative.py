#!/usr/bin/env python
"""Speculative decoding benchmark: speculation off against each mode, in one daemon.

One mlxd daemon (``python -m mlxd serve``, ``[batch] size`` = the largest C and at least 8,
prompt cache off, greedy) serves waves of C concurrent streamed chat
requests. Before each wave the daemon is reloaded (SIGHUP) to the wave's
``[speculative] mode``; the modes alternate wave by wave, for each C and
task, so they share the machine's background load. Two tasks:

- ``copy``: "copy this text exactly" over a paragraph (prompt lookup's case:
  the answer re-emits its prompt);
- ``chat``: free answers to short questions (little to look up).

Per wave: aggregate tokens/s (completion tokens / wave wall time), the median
time per output token of its streams (first to last token), and the drafted
and accepted tokens of the wave (``/stats`` counters). ``--mlx-lm`` adds
mlx-lm's own speculative path side by side at C = 1 on the copy task:
``stream_generate`` plain and with ``draft_model`` (mlx-lm has no prompt
lookup; the draft is the target itself, so it shows the mechanics, not a
gain), in a subprocess with the daemon's BLAS.

Per speculative wave it also reports the accepted tokens per verify step and
the depths the cost model chose (``/stats`` ``batch.spec_depth`` sampled
every 0.25 s while rows run).

Usage: ``python benchmarks/speculative.py [--model DIR|demo] [--concurrency 1,2,4,8,16]
[--max-tokens N (default: copy 128, chat 96)] [--modes off,prompt_lookup]
[--tasks copy,chat] [--repeats N] [--mlx-lm]``; with ``--repeats`` the modes alternate N times
per task and C, and the table gives median rates and each repeat's ratio.
A Markdown table goes to stdout, JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from servebench.processes import Server, blas_env, free_port, resolve_model  # noqa: E402

logger = logging.getLogger("bench")

PARAGRAPHS = [  # texts the demo model copies (nearly) exactly, longest first
    '[{"id": 1, "title": "Buy milk", "done": false}, {"id": 2, "title": "Call the plumber", '
    '"done": true}, {"id": 3, "title": "Water the plants", "done": false}, {"id": 4, "title": '
    '"Pay the gas bill", "done": true}, {"id": 5, "title": "Book the dentist", "done": false}, '
    '{"id": 6, "title": "Return the library books", "done": false}]',
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on "
    "a mountain, because the air pressure is lower there. Cooks at high altitude add time "
    "to recipes that boil, and pressure cookers raise the boiling point again. Salt raises "
    "the boiling point a little, but far less than most cooks believe.",
    '{"name": "garden-sensor", "version": "1.4.2", "battery": 0.82, "readings": [{"kind": '
    '"soil", "value": 31.5}, {"kind": "air", "value": 18.2}, {"kind": "light", "value": 640}]}',
    '{"name": "garden-sensor", "version": "1.4.2", "readings": [{"kind": "soil", "value": '
    '31.5, "unit": "percent"}, {"kind": "air", "value": 18.2, "unit": "celsius"}], '
    '"battery": 0.82, "last_seen": "2026-03-01T06:30:00Z"}',
]
QUESTIONS = [
    "Why is the sky blue?", "What makes a good cup of tea?", "How do bees make honey?",
    "Why do cats purr?", "What is a prime number?", "How does a bicycle stay upright?",
    "Why do leaves change colour in autumn?", "What is the tallest mountain on Earth?",
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default="demo", help="an mlx-lm model directory, or demo")
    p.add_argument("--demo-dtype", default="auto")
    p.add_argument("--blas", default="auto")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="per request (default: copy 128, chat 96)"
    )
    p.add_argument("--modes", default="off,prompt_lookup")
    p.add_argument("--tasks", default="copy,chat")
    p.add_argument("--max-draft-tokens", type=int, default=4)
    p.add_argument(
        "--saturation-tokens", type=int, default=None, help="default: unset (by backend)"
    )
    p.add_argument("--draft-model", default=None, help='mode "draft": its directory')
    p.add_argument("--mlx-lm", action="store_true", help="mlx-lm's speculative path at C=1")
    p.add_argument("--quick", action="store_true", help="smoke test: C = 2, 16 tokens, no warm-up")
    p.add_argument(
        "--repeats", type=int, default=1, help="waves per mode, alternating (medians reported)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.modes = args.modes.split(",")
    args.tasks = args.tasks.split(",")
    if args.quick:
        args.concurrency, args.max_tokens = [2], 16
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"speculative-{stamp}.json"
    return args


def config(args: argparse.Namespace, model_dir: str, mode: str) -> str:
    import tomli_w

    spec: dict[str, Any] = {"mode": mode, "max_draft_tokens": args.max_draft_tokens}
    if args.saturation_tokens is not None:
        spec["saturation_tokens"] = args.saturation_tokens
    if mode == "draft":
        spec["draft_model"] = args.draft_model or model_dir
    return tomli_w.dumps(
        {
            "server": {"log_level": "warning"},
            "model": {"path": model_dir, "name": "bench"},
            # At least the default 8: size = 1 is the serial lane, which does not speculate.
            "batch": {
                "size": max(8, *args.concurrency),
                "prompt_concurrency": max(args.concurrency),
            },
            "prompt_cache": {"max_entries": 0},
            "sampling": {"temperature": 0.0},
            "runtime": {"blas": args.blas},
            "speculative": spec,
        }
    )


def max_tokens_for(args: argparse.Namespace, task: str) -> int:
    return args.max_tokens or (128 if task == "copy" else 96)


def messages(task: str, i: int) -> list[dict[str, str]]:
    if task == "copy":
        text = PARAGRAPHS[i % len(PARAGRAPHS)]
        return [{"role": "user", "content": f"Copy this text exactly, word for word:\n\n{text}"}]
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
    return {"tokens": tokens, "tpot": tpot}


async def depths(client: httpx.AsyncClient, seen: dict[int, int]) -> None:
    """Sample ``/stats`` ``batch.spec_depth`` (the last step's depth) while a row decodes."""
    while True:
        stats = (await client.get("/stats")).json()
        batch = stats["batch"]
        if batch.get("active_rows", 0) > batch.get("prefilling_rows", 0):  # some row decodes
            depth = batch.get("spec_depth", 0)
            seen[depth] = seen.get(depth, 0) + 1
        await asyncio.sleep(0.25)


async def wave(
    url: str, args: argparse.Namespace, task: str, c: int, max_tokens: int | None = None
) -> dict[str, Any]:
    seen: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        bodies = [
            {
                "model": "bench",
                "messages": messages(task, i),
                "max_tokens": max_tokens or max_tokens_for(args, task),
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for i in range(c)
        ]
        sampler = asyncio.create_task(depths(client, seen))
        started = time.perf_counter()
        results = await asyncio.gather(*(stream(client, b) for b in bodies))
        wall = time.perf_counter() - started
        sampler.cancel()
    tokens = sum(r["tokens"] for r in results)
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tps": tokens / wall,
        "tpot_ms": 1000 * statistics.median(tpots) if tpots else None,
        "depths": dict(sorted(seen.items())),
    }


def reload_to(server: Server, url: str, mode: str, path: Path, text: str) -> None:
    path.write_text(text)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/stats", timeout=10).json()
        if stats["batch"].get("spec_mode") == mode and stats["state"] == "ready":
            return
        time.sleep(0.2)
    raise TimeoutError(f"the daemon did not switch to mode {mode}")


def counters(url: str) -> dict[str, int]:
    c = httpx.get(f"{url}/stats", timeout=10).json()["counters"]
    return {k: c[k] for k in ("spec_drafted_tokens", "spec_accepted_tokens", "spec_verify_steps")}


def run_mlxd(args: argparse.Namespace, model_dir: str, workdir: Path) -> tuple[list, dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = workdir / "mlxd.toml"
    cfg.write_text(config(args, model_dir, args.modes[0]))
    cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(cfg), "--port", str(port)]
    rows = []
    with Server(
        "mlxd", cmd, blas_env({}), f"{url}/ready", workdir / "mlxd.log", f"{url}/stats"
    ) as server:
        runtime = httpx.get(f"{url}/stats", timeout=10).json()["runtime"]
        for task in args.tasks:
            for c in args.concurrency:
                for rep, mode in itertools.product(range(args.repeats), args.modes):
                    reload_to(server, url, mode, cfg, config(args, model_dir, mode))
                    if not args.quick:
                        asyncio.run(wave(url, args, task, 1, 8))  # warm-up, not counted
                    before = counters(url)
                    result = asyncio.run(wave(url, args, task, c))
                    after = counters(url)
                    spec = {k: after[k] - before[k] for k in after}
                    row = {"task": task, "c": c, "mode": mode, "repeat": rep, **result, **spec}
                    logger.info("%s", row)
                    rows.append(row)
    return rows, runtime


MLX_LM = r"""
import json, sys, time
from mlx_lm import load, stream_generate
model, tok = load(sys.argv[1])
max_tokens, k, text = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
out = {}
for name, kw in (("plain", {}), ("draft", {"draft_model": model, "num_draft_tokens": k})):
    for _ in range(2):  # the first run warms up
        last = None
        for r in stream_generate(model, tok, prompt, max_tokens=max_tokens, **kw):
            last = r
    out[name] = {"tokens": last.generation_tokens, "tps": last.generation_tps}
print(json.dumps(out))
"""


def run_mlx_lm(args: argparse.Namespace, model_dir: str, runtime: dict) -> dict[str, Any]:
    text = f"Copy this text exactly, word for word:\n\n{PARAGRAPHS[0]}"
    done = subprocess.run(
        [sys.executable, "-c", MLX_LM, model_dir, str(max_tokens_for(args, "copy")),
         str(args.max_draft_tokens), text],
        capture_output=True, text=True, env=blas_env(runtime), check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def merged(waves: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's waves (its repeats) as one row: median rates, summed counters."""
    tpots = [w["tpot_ms"] for w in waves if w["tpot_ms"]]
    depths: dict[Any, int] = {}
    for w in waves:
        for d, n in w["depths"].items():
            depths[d] = depths.get(d, 0) + n
    out: dict[str, Any] = {
        "tps": statistics.median(w["tps"] for w in waves),
        "each": [w["tps"] for w in sorted(waves, key=lambda w: w.get("repeat", 0))],
        "tpot_ms": statistics.median(tpots) if tpots else None,
        "depths": depths,
    }
    for k in ("spec_drafted_tokens", "spec_accepted_tokens", "spec_verify_steps"):
        out[k] = sum(w[k] for w in waves)
    return out


def table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    head = "| task | C | " + " | ".join(f"{m} tok/s" for m in modes)
    head += " | " + " | ".join(f"{m} ms/token" for m in modes)
    head += " | " + " | ".join(f"{m} vs off (each repeat)" for m in modes[1:])
    head += " | accepted/drafted, verify steps, accepted per step | depths seen (depth: samples) |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    keys = sorted({(r["task"], r["c"]) for r in rows}, key=lambda k: (k[0] != "copy", k[1]))
    for task, c in keys:
        by = {m: merged([r for r in rows if (r["task"], r["c"], r["mode"]) == (task, c, m)])
              for m in modes}  # fmt: skip
        base = by[modes[0]]["tps"]
        cells = [f"{by[m]['tps']:.1f}" for m in modes]
        cells += [f"{by[m]['tpot_ms']:.0f}" if by[m]["tpot_ms"] else "—" for m in modes]
        for m in modes[1:]:
            ratios = [on / off for on, off in zip(by[m]["each"], by[modes[0]]["each"], strict=True)]
            each = f" ({' '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
            cells.append(f"{statistics.median(ratios):.2f}{each}" if base else "—")
        spec, seen = [], []
        for m in modes[1:]:
            r = by[m]
            steps = r["spec_verify_steps"]
            per = f"{r['spec_accepted_tokens'] / steps:.1f}" if steps else "—"
            spec.append(f"{r['spec_accepted_tokens']}/{r['spec_drafted_tokens']}, {steps}, {per}")
            seen.append(" ".join(f"{d}: {n}" for d, n in sorted(r["depths"].items())) or "—")
        lines.append(
            f"| {task} | {c} | " + " | ".join(cells) + " | " + "; ".join(spec)
            + " | " + "; ".join(seen) + " |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the depth sampler's requests
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        workdir = Path(tmp)
        model_dir, dtype = resolve_model(args, workdir)
        rows, runtime = run_mlxd(args, model_dir, workdir)
        side = run_mlx_lm(args, model_dir, runtime) if args.mlx_lm else None
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"model: {model_dir} ({dtype}), max_tokens {args.max_tokens or 'copy 128, chat 96'}, "
          f"max_draft_tokens {args.max_draft_tokens}, "
          f"saturation_tokens {args.saturation_tokens or 'unset (by backend)'}, "
          f"BLAS {runtime.get('blas')}, load average at the end {load}\n")  # fmt: skip
    print(table(rows, args.modes))
    if side:
        print(f"\nmlx-lm at C = 1, copy task: {json.dumps(side)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "mlx_lm": side, "runtime": runtime}, indent=1))
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
