"""Several models in one daemon: cold starts, evictions, and two models at once.

Starts ``mlxd serve`` with two chat models (by default the demo model and a
random 8-layer llama, the one ``benchmarks/cluster.py`` builds) and reports,
in one run:

- **cold TTFT**: a streaming request for an unloaded model, time to its first
  token (load + prefill), against the same request once the model is warm;
- **eviction cycle**: with a budget that holds one of the two models, a
  request alternating between them pays an unload and a load each time;
  the mean latency of such a request against a warm one;
- **two models at once**: aggregate decode tokens/s of C streams to each
  model alone, then C streams to each at the same time.

Embeddings per second are ``benchmarks/embeddings.py``.

    python benchmarks/fleet.py
    python benchmarks/fleet.py --a ~/models/Qwen3-0.6B-4bit --b ~/models/gemma-3-1b-4bit
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster import bench_model, free_port, log, wait_ready  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def weights(path: Path | None) -> int:
    if path is None:  # the demo model, float32 on a Linux CPU with OpenBLAS
        from mlxd import demo

        for dtype in ("float32", "bfloat16", "q4"):
            files = list(demo.demo_model_dir(dtype).glob("*.safetensors"))
            if files:
                return sum(f.stat().st_size for f in files)
        return 540 * 1024**2
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def entry(path: Path | None) -> str:
    return f'path = "{path}"\n' if path else ""


def start(work: Path, a: Path | None, b: Path, budget: int | None, name: str) -> tuple[Any, str]:
    port = free_port()
    cfg = work / f"{name}.toml"
    text = f"[server]\nport = {port}\n[batch]\nsize = 8\n"
    if budget is not None:
        text += f"[memory]\nbudget = {budget}\n"
    cache = 'prompt_cache = { max_bytes = "64MiB" }\n'
    text += f"[models.a]\n{entry(a)}{cache}[models.b]\n{entry(b)}{cache}"
    cfg.write_text(text)
    logfile = open(work / f"{name}.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, f"mlxd did not get ready; see {work}")
    return proc, url


def stop(proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream(url: str, model: str, tokens: int) -> tuple[int, float, float | None, float]:
    """(tokens, start, first-token time, end time) of one streaming chat completion."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    n, first, started = 0, None, time.perf_counter()
    with (
        httpx.Client(base_url=url, timeout=600) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                first = first or time.perf_counter()
            if '"completion_tokens"' in line:
                import json

                n = json.loads(line[6:])["usage"]["completion_tokens"]
    return n, started, first, time.perf_counter()


def ttft(url: str, model: str) -> float:
    _, started, first, _ = stream(url, model, 2)
    assert first is not None
    return first - started


def aggregate(url: str, models: list[str], tokens: int, c: int) -> float:
    """Decode tokens/s of ``c`` concurrent streams to each of ``models``, together."""
    results: list[Any] = []
    lock = threading.Lock()

    def run(model: str) -> None:
        out = stream(url, model, tokens)
        with lock:
            results.append(out)

    threads = [threading.Thread(target=run, args=(m,)) for m in models for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = min(r[2] for r in results if r[2])
    end = max(r[3] for r in results)
    return sum(r[0] - 1 for r in results) / (end - first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", help="model a's directory (default: the demo model)")
    parser.add_argument("--b", help="model b's directory (default: a random 8-layer llama)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxd-fleet-bench-"))
    cache = Path(os.environ.get("MLXD_CACHE_DIR", Path.home() / ".cache" / "mlxd"))
    a = Path(args.a).expanduser() if args.a else None
    b = Path(args.b).expanduser() if args.b else bench_model(cache)

    log("daemon 1: both models fit")
    proc, url = start(work, a, b, None, "both")
    try:
        cold = {m: ttft(url, m) for m in ("a", "b")}
        warm = {m: ttft(url, m) for m in ("a", "b")}
        alone = {m: aggregate(url, [m], args.tokens, args.concurrency) for m in ("a", "b")}
        together = aggregate(url, ["a", "b"], args.tokens, args.concurrency)
    finally:
        stop(proc)

    # Room for the larger model, its prompt cache and a row's KV; never for both.
    room = max(min(weights(a), weights(b)) // 2, 8 * 1024**2)
    budget = max(weights(a), weights(b)) + 64 * 1024**2 + room
    log(f"daemon 2: a budget of {budget / 2**20:.0f} MiB holds one model at a time")
    proc, url = start(work, a, b, budget, "one")
    try:
        ttft(url, "a")
        cycle = []
        for i in range(args.cycles):
            model = "b" if i % 2 == 0 else "a"
            _, started, first, _ = stream(url, model, 2)
            cycle.append(first - started)
        events = httpx.get(f"{url}/stats").json()["fleet"]["events"]
        evictions = sum(e["kind"] == "evicted" for e in events)
    finally:
        stop(proc)

    print(f"a: {a or 'demo model'}\nb: {b}\n")
    print("| | a | b |\n| --- | ---: | ---: |")
    print(f"| cold TTFT (load + prefill), s | {cold['a']:.2f} | {cold['b']:.2f} |")
    print(f"| warm TTFT, s | {warm['a']:.3f} | {warm['b']:.3f} |")
    print(f"| {args.concurrency} streams alone, tok/s | {alone['a']:.1f} | {alone['b']:.1f} |")
    print(
        f"\n{args.concurrency} streams to each model at once: {together:.1f} tok/s "
        f"(alone: {alone['a']:.1f} + {alone['b']:.1f} = {alone['a'] + alone['b']:.1f})"
    )
    print(
        f"eviction cycle: {sum(cycle) / len(cycle):.2f} s per request that evicts one model "
        f"and loads the other ({evictions} evictions in {len(cycle)} requests)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
