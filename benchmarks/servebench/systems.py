"""The three systems under test, each run for one round: mlxd, mlx_lm.server, the ceiling."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servebench.client import run_wave
from servebench.processes import ROOT, Server, free_port, mapped_blas_of, mlxd_config
from servebench.records import WARMUP_TOKENS, Stream, Wave
from servebench.summary import summarize

logger = logging.getLogger("bench")
SCRIPT = ROOT / "benchmarks" / "serving.py"


@dataclass
class Measured:
    """One system's round: per C, the wave's summary and its streams' texts."""

    summaries: dict[int, dict[str, Any]]
    texts: dict[int, list[str]]
    info: dict[str, Any]


def bench_server(
    system: str, base: str, model: str, args: argparse.Namespace, *, stats: bool, pid: int
) -> Measured:
    """A discarded warm-up wave at the largest C, then one wave per C."""
    top = max(args.concurrency)
    logger.info("%s: warm-up wave (C=%d, %d tokens)", system, top, WARMUP_TOKENS)
    warm = run_wave(
        system, base, model, top, args, max_tokens=min(WARMUP_TOKENS, args.max_tokens), stats=False,
        pid=pid,
    )  # fmt: skip
    out = Measured({}, {}, {})
    if any(s.error for s in warm.streams):
        logger.warning("%s: warm-up errors: %s", system, [s.error for s in warm.streams if s.error])
    for c in args.concurrency:
        wave = run_wave(
            system, base, model, c, args, max_tokens=args.max_tokens, stats=stats, pid=pid
        )
        out.summaries[c] = summary = summarize(wave)
        out.texts[c] = [s.text for s in wave.streams]
        errors = [s.error for s in wave.streams if s.error]
        if errors:
            summary["error_samples"] = errors[:3]
        log_wave(system, c, summary)
    return out


def log_wave(system: str, c: int, summary: dict[str, Any]) -> None:
    logger.info(
        "%s C=%d: %s tokens in %.1f s, %.2f tok/s e2e, %.2f decode, %d errors",
        system, c, summary.get("tokens"), summary.get("wall_s") or 0,
        summary.get("e2e_tps") or 0, summary.get("decode_tps") or 0, summary["errors"],
    )  # fmt: skip


def run_mlxd(args: argparse.Namespace, model_dir: str, workdir: Path) -> Measured:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = workdir / "mlxd.toml"
    config.write_text(mlxd_config(args, model_dir, args.batch_size))
    cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(config), "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logger.info("mlxd: starting (%s)", " ".join(cmd))
    log = workdir / "mlxd.log"
    with Server("mlxd", cmd, env, f"{base}/ready", log, stats_url=f"{base}/stats") as server:
        import httpx

        runtime = httpx.get(f"{base}/stats", timeout=10).json().get("runtime", {})
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        out = bench_server("mlxd", base, model, args, stats=True, pid=server.proc.pid)
        final = httpx.get(f"{base}/stats", timeout=10).json()
        runtime["max_kv_bytes_seen"] = final["batch"]["max_kv_bytes_seen"]
        runtime["engine_errors"] = final["counters"]["engine_errors"]
        runtime["pid_maps_blas"] = mapped_blas_of(server.proc.pid)
        runtime["config"] = config.read_text()
    out.info = runtime
    return out


def run_mlx_lm_server(
    args: argparse.Namespace, model_dir: str, env: dict[str, str], workdir: Path
) -> Measured:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "mlx_lm.server", "--model", model_dir,
        "--host", "127.0.0.1", "--port", str(port),
        "--decode-concurrency", str(args.batch_size),
        "--prompt-concurrency", str(args.prompt_concurrency),
        "--prefill-step-size", str(args.prefill_step_size),
        "--prompt-cache-size", "0",
        "--temp", "0", "--max-tokens", str(args.max_tokens), "--log-level", "WARNING",
    ]  # fmt: skip
    logger.info("mlx_lm.server: starting (%s)", " ".join(cmd))
    with Server(
        "mlx_lm.server", cmd, env, f"{base}/health", workdir / "mlx_lm_server.log"
    ) as server:
        info = {"pid_maps_blas": mapped_blas_of(server.proc.pid), "command": " ".join(cmd)}
        out = bench_server(
            "mlx_lm.server", base, "default_model", args, stats=False, pid=server.proc.pid
        )
    out.info = info
    return out


def run_ceiling(
    args: argparse.Namespace, model_dir: str, env: dict[str, str], workdir: Path
) -> Measured:
    spec = {
        "model": model_dir,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prefill_batch_size": args.prompt_concurrency,
        "prefill_step_size": args.prefill_step_size,
    }
    spec_path, out_path = workdir / "ceiling-spec.json", workdir / "ceiling-out.json"
    spec_path.write_text(json.dumps(spec))
    logger.info(
        "ceiling: batch_generate in a subprocess (LD_PRELOAD=%s)", env.get("LD_PRELOAD", "")
    )
    worker = [sys.executable, str(SCRIPT), "--ceiling-worker"]
    subprocess.run([*worker, str(spec_path), str(out_path)], env=env, check=True)
    raw = json.loads(out_path.read_text())
    out = Measured({}, {}, raw["runtime"])
    for c_text, w in raw["waves"].items():
        c = int(c_text)
        streams = [Stream(**s) for s in w["streams"]]
        out.summaries[c] = summary = summarize(
            Wave("ceiling", c, w["t0"], streams, w["peak_kv_bytes"], w["background_cores"])
        )
        summary["batch_stats"] = w["batch_stats"]
        out.texts[c] = [s.text for s in streams]
        log_wave("ceiling", c, summary)
    return out
