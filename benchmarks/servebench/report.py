"""The Markdown report: environment, the main table and the per-system detail table."""

from __future__ import annotations

import contextlib
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any


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
