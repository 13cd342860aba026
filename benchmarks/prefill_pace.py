#!/usr/bin/env python
"""A cached short turn beside a long prefill: ``[batch] prefill_step_seconds`` off and on.

An agent session (a conversation the prompt cache holds) sends a short turn
while another session prefills a ~30k-token prompt. For each value of
``prefill_step_seconds`` (0 = chunks of ``prefill_step_size`` tokens whatever
they cost; the others bound a step's prefill by time), in one run, in a
rotating order, on one model:

- the long prompt is sent; once half of it is prefilled, the short turn
  (its history in the prompt cache, a few new tokens) is sent: its **time to
  first token** (the engine's, from admission) and its cached tokens;
- at three quarters the long request is cancelled: the **time until its
  cancel lands** (from ``cancel()`` until the engine's snapshot no longer
  shows the row: it leaves between two steps);
- the long prompt's **prefill rate** up to the half (tokens per second),
  the cost of smaller chunks.

    python benchmarks/prefill_pace.py                         # tiny llama, 30k tokens
    python benchmarks/prefill_pace.py --model DIR --tokens 30000 --seconds 0,0.25 --repeats 2

Prints a Markdown table (docs/performance.md, "A cached turn beside a long
prefill", has this machine's).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.messages import Failed, Finished
from tests.support.engine import consume, run_all, running_engine, token_request


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 480) for _ in range(n)]


def prefilled(engine, rid: str) -> int:
    for row in engine.snapshot().rows:
        if row.id == rid:
            return row.prefill_done
    return 0


async def until(engine, rid: str, n: int) -> None:
    while prefilled(engine, rid) < n:
        await asyncio.sleep(0.02)


def one(model: Path, seconds: float, step: int, n: int, state: str) -> dict:
    long_prompt = tokens(n, 0)
    history = tokens(600, 1)
    batch = {"prefill_step_size": step, "prefill_step_seconds": seconds}
    keys = {"disk": False, "max_bytes": "8GiB"}
    model_keys = {"path": str(model), "max_context": n + 1024}
    with running_engine(
        model, model=model_keys, batch=batch, prompt_cache=keys, server={"state_dir": state}
    ) as engine:
        run_all(engine, [token_request("history", history, 4)])  # the session so far, cached

        async def main() -> dict:
            handle = engine.submit(token_request("long", long_prompt, 1))
            await handle.accepted()
            events = asyncio.ensure_future(_drain(handle))
            started = time.perf_counter()
            await until(engine, "long", n // 2)
            rate = prefilled(engine, "long") / (time.perf_counter() - started)
            short = await consume(engine, token_request("short", [*history, 7, 8, 9, 10, 11], 1))
            await until(engine, "long", 3 * n // 4)
            asked = time.perf_counter()
            handle.cancel()  # the client sees its end at once; the engine at its next step
            end = await events
            while any(row.id == "long" for row in engine.snapshot().rows):
                await asyncio.sleep(0.01)
            landed = time.perf_counter() - asked
            assert isinstance(short.end, Finished) and isinstance(end, Failed), (short.end, end)
            return {
                "ttft_s": short.end.timings.ttft_s or 0.0,
                "cached": short.end.usage.cached_tokens,
                "cancel_s": landed,
                "rate": rate,
            }

        return asyncio.run(main())


async def _drain(handle):
    last = None
    async for event in handle.events():
        last = event
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: tiny llama)")
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--step", type=int, default=512, help="[batch] prefill_step_size")
    parser.add_argument("--seconds", default="0,0.25", help="prefill_step_seconds values")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from tests.support.tinymodels import tiny_model_dir

        args.model = tiny_model_dir("llama")
    values = [float(v) for v in args.seconds.split(",")]
    rows: dict[float, list[dict]] = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as state:
        for r in range(args.repeats):
            for v in values[r % len(values) :] + values[: r % len(values)]:
                print(f"round {r + 1}: prefill_step_seconds={v}", file=sys.stderr)
                rows[v].append(one(args.model, v, args.step, args.tokens, state))
    print(
        f"\n{args.model.name}, a {args.tokens}-token prefill, prefill_step_size {args.step}, "
        f"medians of {args.repeats}\n"
    )
    print(
        "| prefill_step_seconds | cached turn: cached | cached turn: TTFT s "
        "| cancel lands s | long prefill tok/s |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for v in values:
        rs = rows[v]

        def med(key: str, rs=rs) -> float:
            return statistics.median(x[key] for x in rs)

        print(
            f"| {v:g} | {med('cached'):.0f} | {med('ttft_s'):.2f} | {med('cancel_s'):.2f} "
            f"| {med('rate'):.0f} |"
        )


if __name__ == "__main__":
    main()
