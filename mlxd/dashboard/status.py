"""The status bar, the KV gauge and the memory panel: the default chat model as it stands.

Each function takes the dashboard's state (``/stats`` as a dict, plus what the
HTTP side adds; see :mod:`mlxd.dashboard.page`) and returns what its partial
template shows, in human units. Templates only place these values.
"""

from __future__ import annotations

from typing import Any

from mlxd.dashboard.charts import every_model
from mlxd.dashboard.formatting import (
    Formatted,
    ago,
    bar_width,
    clock,
    count,
    duration,
    human_bytes,
    iso,
    percent,
)


def _default_chat(s: dict[str, Any]) -> dict[str, Any] | None:
    """The fleet's default chat model (``/stats`` ``fleet.models``), when the state has it."""
    models = (s.get("fleet") or {}).get("models") or []
    return next((m for m in models if m.get("default") and m.get("kind") == "chat"), None)


def status_bar(s: dict[str, Any], now: float) -> Formatted:
    model, batch, runtime, config = s["model"], s["batch"], s["runtime"], s["config"]
    # An unloaded default model has no engine numbers yet: say what the fleet says of it
    # (its id, "unloaded"), not "(no model)" and "cannot batch" (issue 33).
    default = _default_chat(s)
    loaded = default is None or default["state"] == "loaded"
    name = model["name"] or (default["id"] if default is not None else None)
    status = model["status"] if loaded or default is None else default["state"]
    if s["mode"] == "serial":
        mode = "serial"
    elif not loaded:
        mode = f"batch {batch['configured']} (model {status}: loads on its first request)"
    elif batch["batched"]:
        mode = f"batch {batch['configured']}"
    else:
        mode = f"batch {batch['configured']} (model cannot batch: serial)"
    blas = str(runtime.get("blas") or "—")
    if runtime.get("blas_threads"):
        blas += f", {runtime['blas_threads']} threads"
    return {
        "model": name or "(no model)",
        "model_status": status,
        "model_error": model["error"],
        "family": model["family"] or "—",
        "context": count(model["context"]) if model["context"] else "—",
        "mode": mode,
        "state": s["state"],
        "stalled": s["stalled"],
        "stalled_reason": s.get("stalled_reason"),
        # The loaded models fill [memory] budget: no request can be served (issue 22).
        "over_budget": (s.get("fleet") or {}).get("over_budget"),
        # The daemon's age (the HTTP side adds it), not the default engine's.
        "uptime": duration(now - s["daemon_started_at"])
        if s.get("daemon_started_at")
        else duration(s["uptime_s"]),
        "config_version": config["version"],
        "config_applied": clock(config["applied_at"]),
        "config_applied_iso": iso(config["applied_at"]),
        "config_applied_ago": ago(config["applied_at"], now),
        "config_source": config["source"] or "defaults",
        "device": runtime.get("device") or "—",
        "blas": blas,
        "blas_optimized": bool(runtime.get("blas_optimized")),
        "last_error": s["last_error"],
        "last_error_at": clock(s.get("last_error_at")),
        "last_error_iso": iso(s.get("last_error_at")),
        "last_error_ago": ago(s.get("last_error_at"), now),
    }


def _scope(s: dict[str, Any]) -> str:
    """Which model the panel shows, said when there are several chat models ("" else)."""
    found = every_model(s)
    return str(found["scope"]) if found["several"] else ""


def kv_gauge(s: dict[str, Any], now: float) -> Formatted:
    b, pc = s["batch"], s["prompt_cache"]
    budget = b["kv_budget_bytes"]
    return {
        "scope": _scope(s),
        "live": human_bytes(b["kv_bytes"]),
        "projected": human_bytes(b["kv_projected_bytes"]),
        "budget": human_bytes(budget),
        "budget_auto": b["kv_budget_auto"],
        "live_width": bar_width(b["kv_bytes"], budget),
        "projected_width": bar_width(b["kv_projected_bytes"], budget),
        "live_pct": percent(b["kv_bytes"], budget),
        "projected_pct": percent(b["kv_projected_bytes"], budget),
        "over_budget": b["kv_projected_bytes"] > budget > 0,
        "peak": human_bytes(b["max_kv_bytes_seen"]),
        "paused": b["admission_paused"],
        "cache_bytes": human_bytes(pc["bytes"]),
        "cache_max": human_bytes(pc["max_bytes"]),
        "cache_width": bar_width(pc["bytes"], pc["max_bytes"]),
        "cache_pct": percent(pc["bytes"], pc["max_bytes"]),
        "cache_entries": f"{pc['entries']} / {pc['max_entries']}",
    }


def _kv_bits(b: dict[str, Any]) -> str:
    """ "8-bit KV, 288 B/token (1024 unquantized: 72% saved)" when the KV cache is quantized
    ([batch] kv_bits), else ""."""
    bits = b.get("kv_bits") or 0
    if not bits:
        return ""
    per_token = b.get("kv_bytes_per_token", 0)
    text = f"{bits}-bit KV, {per_token} B/token"
    plain = b.get("kv_unquantized_bytes_per_token") or 0
    if plain > per_token:
        text += f" ({plain} unquantized: {round(100 * (1 - per_token / plain))}% saved)"
    return text


def memory(s: dict[str, Any], now: float) -> Formatted:
    m, model, b = s.get("memory") or {}, s["model"], s["batch"]
    proc = s.get("process") or {}
    return {
        "rss": human_bytes(proc.get("rss_bytes")),
        "rss_label": proc.get("rss_label") or "RSS",
        "active": human_bytes(m.get("active_bytes")),
        "peak": human_bytes(m.get("peak_bytes")),
        "cache": human_bytes(m.get("cache_bytes")),
        "weights": human_bytes(model.get("weights_bytes") or None),
        "dtype": model.get("dtype") or "—",
        "kv": human_bytes(b["kv_bytes"]),
        "kv_budget": human_bytes(b["kv_budget_bytes"]),
        "kv_bits": _kv_bits(b),
        "active_width": bar_width(m.get("active_bytes", 0), m.get("peak_bytes", 0)),
        "scope": _scope(s),
    }
