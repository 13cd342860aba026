"""Server subprocesses, their configs and BLAS environments, and the model under test."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port  # noqa: E402  (after ROOT is importable)

__all__ = [
    "ROOT",
    "Server",
    "blas_env",
    "describe_dtype",
    "free_port",
    "mapped_blas_of",
    "mlxd_config",
    "resolve_model",
]

logger = logging.getLogger("bench")


class Server:
    """A server subprocess with its log file, started and awaited on a readiness URL.

    ``stats_url``, when given, is read while waiting: an mlxd whose model failed
    to load reports ``state: failed`` there (and ``/ready`` stays 503 forever).
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        ready_url: str,
        log_path: Path,
        stats_url: str | None = None,
    ):
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, log_path
        self.ready_url, self.stats_url = ready_url, stats_url
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "ab")  # closed in __exit__
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        try:
            self._wait_ready(deadline=time.monotonic() + 900)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, deadline: float) -> None:
        import httpx

        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(self.ready_url, timeout=2).status_code == 200:
                    return
                if self.stats_url:
                    stats = httpx.get(self.stats_url, timeout=2).json()
                    if stats.get("state") == "failed":
                        raise RuntimeError(f"{self.name}: {stats['model'].get('error')}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} was not ready after 900 s:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        # The server was gone when the block failed: say how it ended, with its log,
        # instead of leaving only the client's "connection refused".
        died = bool(exc) and exc[0] is not None and proc is not None and proc.poll() is not None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._log.close()
        if died and proc is not None:
            raise RuntimeError(
                f"{self.name} exited with {proc.returncode} while in use:\n{self.log_tail()}"
            )

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


def mapped_blas_of(pid: int) -> list[str]:
    """The BLAS-like libraries mapped in process ``pid``, from its /proc maps.

    NumPy's own ``libscipy_openblas64_`` (suffixed symbols, never used by MLX)
    shows up too; what matters is whether the preloaded library is listed.
    """
    found: dict[str, None] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1]
            if path.startswith("/") and "blas" in os.path.basename(path).lower():
                found[path] = None
    return list(found)


def mlxd_config(args: argparse.Namespace, model_dir: str, batch_size: int) -> str:
    import tomli_w

    return tomli_w.dumps(
        {
            "server": {"log_level": "warning"},
            "model": {"path": model_dir, "name": "bench"},
            "batch": {
                "size": batch_size,
                "prompt_concurrency": args.prompt_concurrency,
                "prefill_step_size": args.prefill_step_size,
                "kv_budget": "16GiB",
            },
            "prompt_cache": {"max_entries": 0},
            "sampling": {"temperature": 0.0},
            "runtime": {"blas": args.blas},
        }
    )


def blas_env(runtime: dict[str, Any]) -> dict[str, str]:
    """The environment that reproduces mlxd's BLAS in another process."""
    env = {k: v for k, v in os.environ.items() if k != "MLXD_BLAS_REEXEC"}
    if (
        runtime.get("blas_optimized")
        and runtime.get("blas_path")
        and sys.platform.startswith("linux")
    ):
        previous = env.get("LD_PRELOAD", "")
        if runtime["blas_path"] not in previous.split(":"):
            env["LD_PRELOAD"] = (
                f"{runtime['blas_path']}:{previous}" if previous else runtime["blas_path"]
            )
        if runtime.get("blas_threads"):
            env["OPENBLAS_NUM_THREADS"] = str(runtime["blas_threads"])
    return env


def resolve_model(args: argparse.Namespace, workdir: Path) -> tuple[str, str]:
    """The model directory and a description of its dtype."""
    if args.model != "demo":
        path = Path(args.model).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"--model {args.model}: not an mlx-lm model directory (no config.json)"
            )
        return str(path), describe_dtype(path)
    cfg = workdir / "demo.toml"
    cfg.write_text(f'[runtime]\nblas = "{args.blas}"\n[model]\ndemo_dtype = "{args.demo_dtype}"\n')
    logger.info("preparing the demo model (demo_dtype %s)", args.demo_dtype)
    out = subprocess.run(
        [sys.executable, "-m", "mlxd", "demo-model", "--config", str(cfg)],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"mlxd demo-model failed:\n{out.stderr[-3000:]}")
    path = Path(out.stdout.strip().splitlines()[-1])
    return str(path), describe_dtype(path)


def describe_dtype(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization")
    if quant:
        return f"{quant.get('bits')}-bit (group {quant.get('group_size')})"
    return str(config.get("torch_dtype") or config.get("dtype") or "unknown")
