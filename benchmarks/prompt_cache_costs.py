"""What prompt-cache checkpoints and the disk tier cost and save, mlxd against itself.

For each ``[prompt_cache] checkpoint_every`` value (0 = only the system
prefix's and the prompt's end), on one model, in one run, in a rotating
order: a cold prefill of a long prompt (its time, the checkpoints it kept and
their RAM bytes), then an edited copy of that prompt (changed at a random
point in the middle), whose prefill starts from the last checkpoint before
the change (its cached tokens and time to first token). Then the disk tier:
the engine's flush of the RAM entries (the writer thread's time per MiB) and a
fresh engine's first hit (the engine thread's read time per MiB).

    python benchmarks/prompt_cache_costs.py                      # tiny qwen3_5, 8k tokens
    python benchmarks/prompt_cache_costs.py --model ~/models/Qwen3.5-35B-A3B-4bit --tokens 30000

Prints a Markdown table (docs/design.md, "Checkpoints", has this machine's).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.messages import Finished
from tests.support.engine import run_all, running_engine, settled, token_request


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 480) for _ in range(n)]


def served(model: Path, n: int) -> dict:
    return {"path": str(model), "max_context": 2 * n + 64}


def one(model: Path, every: int, prompt: list[int], edit_at: int, state: str) -> dict:
    keys = {"checkpoint_every": every, "disk": False, "max_bytes": "64GiB"}
    with running_engine(
        model, model=served(model, len(prompt)), prompt_cache=keys, server={"state_dir": state}
    ) as engine:
        started = time.perf_counter()
        (cold,) = run_all(engine, [token_request("cold", prompt, 1)])
        cold_s = time.perf_counter() - started
        after = settled(engine).prompt_cache
        edited = [*prompt[:edit_at], *tokens(8, every), *prompt[edit_at + 8 :]]
        (warm,) = run_all(engine, [token_request("edited", edited, 1)])
    assert isinstance(cold.end, Finished) and isinstance(warm.end, Finished)
    return {
        "every": every,
        "cold_s": cold_s,
        "checkpoints": after.checkpoints,
        "ram_mib": after.bytes / 2**20,
        "cached": warm.end.usage.cached_tokens,
        "ttft_s": warm.end.timings.ttft_s or 0.0,
    }


def disk(model: Path, prompt: list[int], state: str) -> dict:
    keys = {"checkpoint_every": 0, "disk": True, "disk_dir": str(Path(state) / "cache")}
    kw = {"model": served(model, len(prompt)), "prompt_cache": keys, "server": {"state_dir": state}}
    with running_engine(model, **kw) as engine:
        run_all(engine, [token_request("cold", prompt, 1)])
        ram = settled(engine).prompt_cache.bytes
        started = time.perf_counter()
    flush_s = time.perf_counter() - started  # stop = flush every entry + the writer's fsyncs
    with running_engine(model, **kw) as engine:
        (hit,) = run_all(engine, [token_request("hit", [*prompt, 7], 1)])
        state_now = settled(engine).prompt_cache
    assert isinstance(hit.end, Finished) and state_now.disk_hits == 1
    return {
        "mib": state_now.disk_bytes / 2**20,
        "ram_mib": ram / 2**20,
        "flush_s": flush_s,
        "ttft_s": hit.end.timings.ttft_s or 0.0,
        "cached": hit.end.usage.cached_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: tiny qwen3_5)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--every", default="0,512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from tests.support.tinymodels import tiny_model_dir

        args.model = tiny_model_dir("qwen3_5")
    values = [int(v) for v in args.every.split(",")]
    prompt = tokens(args.tokens, 0)
    rng = random.Random(1)
    rows: dict[int, list[dict]] = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as state:
        for r in range(args.repeats):
            order = values[r % len(values) :] + values[: r % len(values)]
            edit_at = rng.randrange(args.tokens // 4, args.tokens * 3 // 4)
            for v in order:
                print(f"round {r + 1}: checkpoint_every={v}", file=sys.stderr)
                rows[v].append(one(args.model, v, prompt, edit_at, state))
        print(f"round: disk tier, {args.tokens} tokens", file=sys.stderr)
        d = disk(args.model, prompt, state)
    print(f"\n{args.model.name}, a {args.tokens}-token prompt, edited at a random point\n")
    columns = ["cold prefill s", "checkpoints", "RAM MiB", "edited: cached", "edited: TTFT s"]
    print("| checkpoint_every | " + " | ".join(columns) + " |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in values:
        rs = rows[v]
        mean = {
            k: sum(x[k] for x in rs) / len(rs) for k in ("cold_s", "ram_mib", "cached", "ttft_s")
        }
        print(
            f"| {v} | {mean['cold_s']:.2f} | {rs[0]['checkpoints']} | {mean['ram_mib']:.1f} "
            f"| {mean['cached']:.0f} | {mean['ttft_s']:.2f} |"
        )
    print(
        f"\ndisk tier: {d['mib']:.1f} MiB on disk for {d['ram_mib']:.1f} MiB in RAM; "
        f"stop and flush {d['flush_s']:.2f} s; after a restart the first hit served "
        f"{d['cached']} tokens, TTFT {d['ttft_s']:.2f} s (the read runs on the engine thread)"
    )


if __name__ == "__main__":
    main()
