"""The numbers of a wave (definitions in benchmarks/README.md) and medians over rounds."""

from __future__ import annotations

import math
import statistics
from typing import Any

from mlxd.api.ops.recent import percentile  # one definition for the daemon and the benchmarks
from servebench.records import Wave


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
