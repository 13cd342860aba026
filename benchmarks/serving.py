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
import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

logger = logging.getLogger("bench")

TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to paint in an abandoned city",
    "two rival bakers in a small mountain village",
    "a girl who can talk to the wind",
    "the last dragon guarding an empty library",
    "a detective cat solving a mystery on a train",
    "an astronaut stranded on a frozen moon",
    "a musician who loses her hearing before a great concert",
    "a family of foxes surviving a harsh winter",
    "a clockmaker who builds a machine that stops time",
    "a pirate captain afraid of the sea",
    "a young wizard failing his final exam",
    "a gardener whose plants grow overnight into a forest",
    "a knight searching for a stolen crown",
    "an old fisherman and a talking whale",
    "a city where it never stops raining",
]
WARMUP_TOKENS = 8


def story_prompt(i: int) -> list[dict[str, str]]:
    """The chat messages of client ``i``: distinct per client, asking for a long answer."""
    topic = TOPICS[i % len(TOPICS)]
    part = f" (version {i // len(TOPICS) + 1})" if i >= len(TOPICS) else ""
    text = (
        f"Write a long story about {topic}{part}. "
        "Describe the characters, the places and every event in detail."
    )
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- records


@dataclass
class Stream:
    """One request as its client saw it; times are ``time.perf_counter()`` seconds."""

    sent: float
    first: float | None = None  # first token (first text chunk, or the end if none)
    end: float | None = None  # the chunk carrying finish_reason
    chunks: list[float] = field(default_factory=list)  # text chunks (tokens, for the ceiling)
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None
    retries: int = 0  # connections that broke before a response and were retried


@dataclass
class Wave:
    """C streams started together at ``t0``."""

    system: str
    concurrency: int
    t0: float
    streams: list[Stream]
    peak_kv_bytes: int | None = None
    background_cores: float | None = None  # CPU others used meanwhile, in cores


# ---------------------------------------------------------------- CPU accounting
# The development machine is shared: other processes' CPU during a wave is
# measured (machine busy time minus the benchmark's own processes) and reported.

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (None off Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def process_cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of one process (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuWindow:
    """Measures the CPU that processes other than ``pids`` used over a window."""

    def __init__(self, *pids: int | str):
        self.pids = pids or ("self",)
        self.start = self._read()
        self.wall = time.monotonic()

    def _read(self) -> tuple[float | None, float]:
        return machine_cpu_s(), sum(process_cpu_s(p) for p in self.pids)

    def background_cores(self) -> float | None:
        (m0, own0), (m1, own1) = self.start, self._read()
        elapsed = time.monotonic() - self.wall
        if m0 is None or m1 is None or elapsed <= 0:
            return None
        return max(0.0, (m1 - m0) - (own1 - own0)) / elapsed


def cpu_busy(seconds: float = 2.0) -> float | None:
    """Fraction of the machine's CPUs busy over ``seconds`` (anyone's work)."""
    m0 = machine_cpu_s()
    time.sleep(seconds)
    m1 = machine_cpu_s()
    if m0 is None or m1 is None:
        return None
    return (m1 - m0) / seconds / (os.cpu_count() or 1)


def wait_for_idle(limit: float, timeout_s: float = 600.0) -> float | None:
    """Wait until the machine is at most ``limit`` busy (0..1); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy()
    while busy is not None and busy > limit and time.monotonic() < deadline:
        logger.info(
            "machine %.0f%% busy (others' work); waiting for <= %.0f%%", busy * 100, limit * 100
        )
        busy = cpu_busy(5.0)
    return busy


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(wave: Wave) -> dict[str, Any]:
    """The numbers of one wave (definitions in the module docstring and README)."""
    ok = [s for s in wave.streams if s.error is None and s.end is not None]
    out: dict[str, Any] = {"streams": len(wave.streams), "errors": len(wave.streams) - len(ok)}
    if not ok:
        return out
    tokens = sum(s.tokens for s in ok)
    last_end = max(s.end for s in ok)
    first_token = min(s.first for s in ok)
    itl = [b - a for s in ok for a, b in zip(s.chunks, s.chunks[1:], strict=False)]
    ttft = [s.first - s.sent for s in ok]
    decode_window = last_end - first_token
    out |= {
        "tokens": tokens,
        "chunks": sum(len(s.chunks) for s in ok),
        "retries": sum(s.retries for s in wave.streams),
        "stopped_on_eos": sum(1 for s in ok if s.finish_reason == "stop"),
        "wall_s": last_end - wave.t0,
        "e2e_tps": tokens / (last_end - wave.t0),
        "decode_tps": sum(s.tokens - 1 for s in ok) / decode_window if decode_window > 0 else None,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p95_ms": 1000 * percentile(ttft, 95),
        "itl_p50_ms": 1000 * percentile(itl, 50) if itl else None,
        "itl_p95_ms": 1000 * percentile(itl, 95) if itl else None,
        "prompt_tokens": [s.prompt_tokens for s in wave.streams],
        "completion_tokens": [s.tokens for s in wave.streams],
        "peak_kv_bytes": wave.peak_kv_bytes,
        "background_cores": wave.background_cores,
    }
    return out


def median_of(runs: list[dict[str, Any]], max_background: float | None = None) -> dict[str, Any]:
    """Each numeric metric's median over the rounds; errors and retries are summed.

    Rounds whose wave ran while other processes used more than
    ``max_background`` cores are left out, as long as one round remains;
    ``rounds_used`` says how many counted. Lists (per-stream prompt and
    completion tokens) come from the first round.
    """
    clean = [r for r in runs if (r.get("background_cores") or 0) <= (max_background or math.inf)]
    used = clean or runs
    out = dict(used[0])
    for key in {k for r in used for k, v in r.items() if _is_number(v)}:
        vals = [r[key] for r in used if _is_number(r.get(key))]
        out[key] = statistics.median(vals)
    for key in ("errors", "retries"):
        out[key] = sum(r.get(key) or 0 for r in runs)
    out["rounds_used"] = len(used)
    return out


def with_medians(results: dict[str, Any], max_background: float | None) -> dict[str, Any]:
    """(Re)compute every system's and C's ``median`` from its ``runs``."""
    for per_c in results.values():
        for entry in per_c.values():
            entry["median"] = median_of(entry["runs"], max_background)
    return results


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------- HTTP client


MAX_RETRIES = 3


async def stream_chat(client: Any, url: str, body: dict[str, Any]) -> Stream:
    """POST one streaming chat completion and time its chunks.

    A connection that breaks before any response arrives is retried (up to
    ``MAX_RETRIES`` times) and counted in ``Stream.retries``; the stream keeps
    its first send time, so the delay shows in its TTFT. This happens with
    ``mlx_lm.server``: its ``ThreadingHTTPServer`` listens with a backlog of
    5, so a burst of 16 new connections overflows the accept queue.
    """
    s = Stream(sent=time.perf_counter())
    for attempt in range(MAX_RETRIES + 1):
        s.retries = attempt
        responded = False
        try:
            async with client.stream("POST", url, json=body) as response:
                responded = True
                if response.status_code != 200:
                    s.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                    return s
                async for line in response.aiter_lines():
                    _take_line(s, line)
                    if s.error:
                        return s
            break
        except Exception as exc:  # reported per stream, the wave goes on
            s.error = f"{type(exc).__name__}: {exc}"
            if responded or attempt == MAX_RETRIES:
                return s
            s.error = None
    if s.end is None or not s.tokens:
        s.error = "the stream ended without finish_reason or usage"
    return s


def _take_line(s: Stream, line: str) -> None:
    """Record one server-sent-events line of a chat completion stream."""
    if not line.startswith("data:"):
        return
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return
    now = time.perf_counter()
    obj = json.loads(payload)
    if "error" in obj:
        s.error = str(obj["error"])[:300]
        return
    usage = obj.get("usage")
    if usage:
        s.tokens = usage.get("completion_tokens") or 0
        s.prompt_tokens = usage.get("prompt_tokens") or 0
    for choice in obj.get("choices") or []:
        text = (choice.get("delta") or {}).get("content")
        if text:
            s.chunks.append(now)
            s.text += text
            if s.first is None:
                s.first = now
        if choice.get("finish_reason"):
            s.finish_reason = choice["finish_reason"]
            s.end = now
            if s.first is None:  # the one token was EOS
                s.first = now


async def _poll_kv(client: Any, url: str, interval: float, peak: list[int]) -> None:
    # The first poll waits one interval: a /stats request that lands in the
    # same millisecond as the burst of new requests changes how mlxd groups
    # them for prefill (see README, "Results"), and the peak comes later anyway.
    while True:
        await asyncio.sleep(interval)
        with contextlib.suppress(Exception):
            batch = (await client.get(url)).json()["batch"]
            if batch["active_rows"]:
                peak[0] = max(peak[0], int(batch["kv_bytes"]))


async def _max_kv_seen(client: Any, base: str) -> int:
    with contextlib.suppress(Exception):
        return int((await client.get(f"{base}/stats")).json()["batch"]["max_kv_bytes_seen"])
    return 0


async def _wave(
    base: str, model: str, prompts: list[list[dict]], max_tokens: int, stats_interval: float | None
) -> tuple[float, list[Stream], int | None]:
    import httpx

    timeout = httpx.Timeout(None, connect=30)
    limits = httpx.Limits(
        max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4
    )
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        peak = [0]
        poller = None
        seen_before = await _max_kv_seen(client, base) if stats_interval else 0
        if stats_interval:
            poller = asyncio.create_task(_poll_kv(client, f"{base}/stats", stats_interval, peak))
        bodies = [
            {
                "model": model,
                "messages": p,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for p in prompts
        ]
        t0 = time.perf_counter()
        streams = await asyncio.gather(
            *(stream_chat(client, f"{base}/v1/chat/completions", b) for b in bodies)
        )
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            # A wave shorter than the poll interval: the engine's own high-water
            # mark, when this wave raised it, is this wave's peak.
            seen_after = await _max_kv_seen(client, base)
            if seen_after > seen_before:
                peak[0] = max(peak[0], seen_after)
    # None: no poll landed while rows were running (a wave shorter than the interval).
    return t0, list(streams), (peak[0] or None) if stats_interval else None


def run_wave(
    system: str,
    base: str,
    model: str,
    c: int,
    args: argparse.Namespace,
    *,
    max_tokens: int,
    stats: bool,
    pid: int,
) -> Wave:
    prompts = [story_prompt(i) for i in range(c)]
    interval = args.stats_interval if stats else None
    window = CpuWindow(pid, "self")
    t0, streams, peak = asyncio.run(_wave(base, model, prompts, max_tokens, interval))
    return Wave(system, c, t0, streams, peak, window.background_cores())


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} was not ready after 900 s:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

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


# ---------------------------------------------------------------- the systems


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
    worker = [sys.executable, str(Path(__file__).resolve()), "--ceiling-worker"]
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


# ---------------------------------------------------------------- the ceiling worker


def ceiling_worker(spec_path: str, out_path: str) -> None:
    """Runs in its own process: ``batch_generate`` per C, with each token timestamped.

    ``BatchGenerator.next_generated`` (what ``batch_generate`` loops on) is
    wrapped to stamp every response as it returns to that loop and to read
    ``prompt_cache_nbytes``; ``batch_generate`` itself is called unchanged.
    """
    spec = json.loads(Path(spec_path).read_text())
    import importlib

    import mlx.core as mx
    import mlx_lm

    # mlx_lm re-exports a function named ``generate``: fetch the module itself.
    gen_mod = importlib.import_module("mlx_lm.generate")

    from mlxd.runtime.blas import describe

    model, tokenizer = mlx_lm.load(spec["model"])
    base_cls = gen_mod.BatchGenerator
    events: list[tuple[int, float, str | None, int]] = []
    peak = [0]

    class TimedBatchGenerator(base_cls):  # type: ignore[misc, valid-type]
        def next_generated(self):
            responses = super().next_generated()
            now = time.perf_counter()
            peak[0] = max(peak[0], self.prompt_cache_nbytes)
            events.extend((r.uid, now, r.finish_reason, r.token) for r in responses)
            return responses

    def run(
        prompts: list[list[int]], c: int, max_tokens: int
    ) -> tuple[float, list[dict], Any, int, float | None]:
        events.clear()
        peak[0] = 0
        gen_mod.BatchGenerator = TimedBatchGenerator
        window = CpuWindow("self")
        try:
            t0 = time.perf_counter()
            response = gen_mod.batch_generate(
                model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True,
                completion_batch_size=c, prefill_batch_size=spec["prefill_batch_size"],
                prefill_step_size=spec["prefill_step_size"],
            )  # fmt: skip
        finally:
            gen_mod.BatchGenerator = base_cls
        eos = set(tokenizer.eos_token_ids)
        streams = []
        for i, prompt in enumerate(prompts):
            mine = [e for e in events if e[0] == i]  # a fresh generator numbers uids 0..C-1
            text_times = [t for _, t, reason, tok in mine if not (reason == "stop" and tok in eos)]
            streams.append(
                asdict(
                    Stream(
                        sent=t0,
                        first=mine[0][1],
                        end=mine[-1][1],
                        chunks=text_times,
                        tokens=len(mine),
                        prompt_tokens=len(prompt),
                        finish_reason=mine[-1][2],
                        text=response.texts[i],
                    )
                )
            )
        return t0, streams, response.stats, peak[0], window.background_cores()

    def tokenize(i: int) -> list[int]:
        return list(tokenizer.apply_chat_template(story_prompt(i), add_generation_prompt=True))

    top = max(spec["concurrency"])
    print(f"ceiling: warm-up (B={top}, {WARMUP_TOKENS} tokens)", file=sys.stderr, flush=True)
    run([tokenize(i) for i in range(top)], top, min(WARMUP_TOKENS, spec["max_tokens"]))
    waves: dict[str, dict] = {}
    for c in spec["concurrency"]:
        prompts = [tokenize(i) for i in range(c)]
        t0, streams, stats, kv, background = run(prompts, c, spec["max_tokens"])
        batch_stats = {
            k: getattr(stats, k)
            for k in ("prompt_tokens", "prompt_time", "generation_tokens", "generation_steps",
                      "decode_time", "wall_time", "generation_time", "overhead_time")
        }  # fmt: skip
        waves[str(c)] = {
            "t0": t0,
            "streams": streams,
            "peak_kv_bytes": kv,
            "background_cores": background,
            "batch_stats": batch_stats,
        }
        print(f"ceiling: B={c} done in {stats.wall_time:.1f} s", file=sys.stderr, flush=True)
    runtime = describe() | {"device": str(mx.default_device())}
    Path(out_path).write_text(json.dumps({"waves": waves, "runtime": runtime}))


# ---------------------------------------------------------------- report


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    from mlxd.config import format_bytes

    return format_bytes(n)


DISPLAY = {"mlxd": "mlxd", "ceiling": "ceiling", "mlx_lm_server": "mlx_lm.server"}


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _pair(m: dict[str, Any], metric: str) -> str:
    return f"{_f(m.get(metric + '_p50_ms'), '{:.0f}')} / {_f(m.get(metric + '_p95_ms'), '{:.0f}')}"


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


MAIN_HEADER = [
    "C", "mlxd tok/s", "ceiling tok/s", "mlxd/ceiling", "mlx_lm.server tok/s",
    "mlxd/mlx_lm.server", "TTFT p50/p95 (ms)", "ITL p50/p95 (ms)", "peak KV",
]  # fmt: skip
DETAIL_HEADER = [
    "C", "system", "e2e tok/s", "decode tok/s", "TTFT p50/p95 (ms)", "ITL p50/p95 (ms)",
    "tokens", "EOS", "errors / retries", "same text as ceiling", "others' CPU (cores)",
    "rounds used",
]  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    """The environment, the main table and the per-system detail table."""
    env, systems, st = report["environment"], report["results"], report["settings"]
    lines = [
        f"model: {env['model_path']} ({env['model_dtype']})",
        f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, Python {env['python']}, {env['platform']}",
        f"CPU: {env['cpu_model']}, {env['cpu_count']} CPUs ({env['cpus_usable']} usable)",
        blas_line(env),
        f"settings: max_tokens {st['max_tokens']}, batch size {st['batch_size']}, prompt "
        f"concurrency {st['prompt_concurrency']}, prefill step {st['prefill_step_size']}, "
        f"repeats {st['repeats']}, greedy, prompt caches off",
        "",
        _row(MAIN_HEADER),
        _row(["---:"] * len(MAIN_HEADER)),
    ]
    for c in st["concurrency"]:
        m = systems["mlxd"][str(c)]["median"]
        ce = systems["ceiling"][str(c)]["median"]
        sv = systems.get("mlx_lm_server", {}).get(str(c), {}).get("median", {})
        tps = m.get("e2e_tps")
        lines.append(
            _row([
                c, _f(tps), _f(ce.get("e2e_tps")), _f(ratio(tps, ce.get("e2e_tps")), "{:.2f}"),
                _f(sv.get("e2e_tps")), _f(ratio(tps, sv.get("e2e_tps")), "{:.2f}"),
                _pair(m, "ttft"), _pair(m, "itl"), human_bytes(m.get("peak_kv_bytes")),
            ])
        )  # fmt: skip
    lines += ["", _row(DETAIL_HEADER), _row(["---:", "---"] + ["---:"] * (len(DETAIL_HEADER) - 2))]
    for c in st["concurrency"]:
        ref = systems["ceiling"][str(c)]["texts"]
        for name in (n for n in DISPLAY if n in systems):
            entry = systems[name][str(c)]
            m = entry["median"]
            same = sum(1 for a, b in zip(entry["texts"], ref, strict=True) if a == b)
            lines.append(
                _row([
                    c, DISPLAY[name], _f(m.get("e2e_tps")), _f(m.get("decode_tps")),
                    _pair(m, "ttft"), _pair(m, "itl"), _f(m.get("tokens"), "{:.0f}"),
                    _f(m.get("stopped_on_eos"), "{:.0f}"),
                    f"{m.get('errors', 0)} / {m.get('retries', 0)}", f"{same}/{len(ref)}",
                    _f(m.get("background_cores"), "{:.2f}"),
                    f"{m.get('rounds_used', len(entry['runs']))}/{len(entry['runs'])}",
                ])
            )  # fmt: skip
    return "\n".join(lines)


def blas_line(env: dict[str, Any]) -> str:
    mlxd, ceiling = env["mlxd_runtime"], env["ceiling_runtime"]
    line = (
        f"BLAS: mlxd {mlxd.get('blas')} ({mlxd.get('blas_path')}, "
        f"{mlxd.get('blas_threads')} threads); ceiling {ceiling.get('blas')} "
        f"({ceiling.get('path')}, {ceiling.get('threads')} threads)"
    )
    server = env.get("mlx_lm_server")
    if server:
        preload = [os.path.realpath(p) for p in (env.get("ld_preload") or "").split(":") if p]
        mapped = {os.path.realpath(p) for p in server.get("pid_maps_blas", [])}
        state = "mapped" if preload and set(preload) <= mapped else "NOT mapped"
        line += f"; mlx_lm.server LD_PRELOAD {env.get('ld_preload')} ({state})"
    threads = env.get("openblas_num_threads")
    return line + (
        f"; OPENBLAS_NUM_THREADS={threads} for the ceiling and mlx_lm.server" if threads else ""
    )


def environment(model_dir: str, dtype: str) -> dict[str, Any]:
    cpu_model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "model_path": model_dir,
        "model_dtype": dtype,
        "mlx": metadata.version("mlx"),
        "mlx_lm": metadata.version("mlx-lm"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
    }


# ---------------------------------------------------------------- main


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
    p.add_argument("--quick", action="store_true", help="smoke test: C=1,4 and 16 tokens")
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
            busy = wait_for_idle(args.wait_idle) if args.wait_idle < 1 else cpu_busy()
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
