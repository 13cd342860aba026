"""Two ranks against one: what sharding a model over a cluster costs per step.

Starts ``mlxd serve`` on one machine (no ``[cluster]``), measures, stops it;
then starts a two-rank ``ring`` cluster on 127.0.0.1 with the same model and
measures the same way. Reports decode tokens/s for one stream and for C
concurrent streams, and, for the cluster, rank 0's time in plan and digest
collectives per step (``/stats`` ``cluster.comm_seconds / steps``).

On one box two ranks share the same CPU or GPU and only add communication:
expect them to be slower. The point of a cluster is memory (a model that
does not fit one machine), not speed; docs/cluster.md.

    python benchmarks/cluster.py                      # a random 8-layer llama
    python benchmarks/cluster.py --model ~/models/Qwen3-0.6B --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
PROMPT = [5, 17, 42, 99, 7, 120, 3, 64, 88, 19]
sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port  # noqa: E402  (after ROOT is importable)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_model(out: Path) -> Path:
    """A random-weight llama big enough that compute is not nothing (about 60M params)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from tests.support.tinymodels import tiny_model_dir

    target = out / "bench-llama"
    if (target / "model.safetensors").is_file():
        return target
    tiny = tiny_model_dir("llama")
    shutil.copytree(tiny, target, dirs_exist_ok=True)
    config = json.loads((tiny / "config.json").read_text())
    config.update(
        hidden_size=768,
        num_hidden_layers=8,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    )
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        fan_in = p.shape[-1] if p.ndim >= 2 else 1
        scale = 0.02 if "embed" in name else (2 / fan_in**0.5 if p.ndim >= 2 else 0.0)
        weights[name] = mx.random.normal(p.shape) * scale + (1.0 if p.ndim == 1 else 0.0)
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def config_text(model: Path, port: int, blas: str, hostfile: Path | None, size: int) -> str:
    text = (
        f'[server]\nport = {port}\n[model]\npath = "{model}"\n'
        f'[runtime]\nblas = "{blas}"\n[batch]\nsize = {size}\n[prompt_cache]\nmax_entries = 0\n'
    )
    if hostfile is not None:
        text += f'[cluster]\nbackend = "ring"\nhostfile = "{hostfile}"\n'
    return text


def start(work: Path, ranks: int, model: Path, blas: str, size: int) -> tuple[list, str]:
    port = free_port()
    hostfile = None
    if ranks > 1:
        hostfile = work / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
    cfg = work / f"mlxd-{ranks}.toml"
    cfg.write_text(config_text(model, port, blas, hostfile, size))
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "MLX_RANK": str(rank)}
        logfile = open(work / f"rank{rank}-of-{ranks}.log", "wb")  # noqa: SIM115
        cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(cfg)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=logfile, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, f"{ranks} rank(s) did not get ready; see {work}")
    return procs, url


def wait_ready(url: str, failure: str, timeout: float = 300) -> None:
    """Until ``url``/ready answers 200; RuntimeError(``failure``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(failure)


def stream(url: str, model: str, tokens: int) -> tuple[int, float | None, float]:
    """(tokens, first-token time, end time) of one streaming completion."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "stream": True}
    n, first = 0, None
    with (
        httpx.Client(base_url=url, timeout=600) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                n += 1
                first = first or time.perf_counter()
    return n, first, time.perf_counter()


def wave(url: str, model: str, tokens: int, c: int) -> float:
    """Aggregate decode tokens/s of ``c`` concurrent streams."""
    results: list[Any] = [None] * c

    def run(i: int) -> None:
        results[i] = stream(url, model, tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = min(r[1] for r in results if r[1])
    end = max(r[2] for r in results)
    return sum(r[0] - 1 for r in results) / (end - first)


def measure(work: Path, ranks: int, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    log(f"starting {ranks} rank(s)")
    procs, url = start(work, ranks, model, args.blas, max(args.concurrency, 1))
    try:
        model_id = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        stream(url, model_id, 8)  # warm up
        before = httpx.get(f"{url}/stats").json().get("cluster") or {}
        one = wave(url, model_id, args.tokens, 1)
        many = wave(url, model_id, args.tokens, args.concurrency)
        after = httpx.get(f"{url}/stats").json().get("cluster") or {}
        out = {"ranks": ranks, "one_stream_tps": one, "c_streams_tps": many}
        if after:
            # Idle: only heartbeats (an empty plan every 100 ms): the bare cost of one plan.
            time.sleep(args.idle)
            idle = httpx.get(f"{url}/stats").json()["cluster"]
            plans = idle["plans"] - after["plans"]
            out["idle_plan_ms"] = 1000 * (idle["comm_seconds"] - after["comm_seconds"]) / plans
            steps = after["steps"] - before["steps"]
            out["comm_ms_per_step"] = (
                1000 * (after["comm_seconds"] - before["comm_seconds"]) / steps
            )
            out["plan_bytes_per_plan"] = (after["plan_bytes"] - before["plan_bytes"]) / max(
                after["plans"] - before["plans"], 1
            )
            out["steps"] = steps
        return out
    finally:
        procs[0].send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="an mlx-lm model directory (default: a random llama)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--blas", default="auto", choices=("auto", "off"))
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle heartbeats")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxd-cluster-bench-"))
    cache = Path(os.environ.get("MLXD_CACHE_DIR", Path.home() / ".cache" / "mlxd"))
    model = Path(args.model).expanduser() if args.model else bench_model(cache)
    rows = [measure(work, ranks, model, args) for ranks in (1, 2)]
    print(f"model: {model}, {args.tokens} tokens per stream, C = {args.concurrency}\n")
    print(
        "| ranks | 1 stream tok/s | C streams tok/s | plan+digest ms/step "
        "| idle plan ms | plan bytes/plan |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        comm = f"{r['comm_ms_per_step']:.2f}" if "comm_ms_per_step" in r else "-"
        idle = f"{r['idle_plan_ms']:.2f}" if "idle_plan_ms" in r else "-"
        size = f"{r['plan_bytes_per_plan']:.0f}" if "plan_bytes_per_plan" in r else "-"
        print(
            f"| {r['ranks']} | {r['one_stream_tps']:.1f} | {r['c_streams_tps']:.1f} "
            f"| {comm} | {idle} | {size} |"
        )
    (work / "cluster.json").write_text(json.dumps(rows, indent=2))
    log(f"logs and cluster.json in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
