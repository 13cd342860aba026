"""Values for the dashboard templates, formatted for people.

Each region of the page has one function here that takes the snapshot dict
(``Snapshot.as_dict(now)``, the same value ``/stats`` serves) and returns
what its partial template shows: strings in human units, percentages, SVG
points. Templates only place these values; they do no arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxd.dashboard.cluster_view import cluster
from mlxd.dashboard.formatting import (
    View,
    ago,
    bar_width,
    clock,
    count,
    duration,
    human_bytes,
    iso,
    percent,
    rate,
    short_id,
)
from mlxd.dashboard.models import models_panel

WAITING_FOR = {
    "budget": "KV budget",
    "batch_full": "batch full",
    "drain": "drain",
    "serial_lane": "its serial turn",
}

CHART_W = 600.0
CHART_H = 120.0


# ---------------------------------------------------------------- formatting


# ---------------------------------------------------------------- regions


def status_bar(s: dict[str, Any], now: float) -> View:
    model, batch, runtime, config = s["model"], s["batch"], s["runtime"], s["config"]
    if s["mode"] == "serial":
        mode = "serial"
    elif batch["batched"]:
        mode = f"batch {batch['configured']}"
    else:
        mode = f"batch {batch['configured']} (model cannot batch: serial)"
    blas = str(runtime.get("blas") or "—")
    if runtime.get("blas_threads"):
        blas += f", {runtime['blas_threads']} threads"
    return {
        "model": model["name"] or "(no model)",
        "model_status": model["status"],
        "model_error": model["error"],
        "family": model["family"] or "—",
        "context": count(model["context"]) if model["context"] else "—",
        "mode": mode,
        "state": s["state"],
        "stalled": s["stalled"],
        "uptime": duration(s["uptime_s"]),
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


def kv_gauge(s: dict[str, Any], now: float) -> View:
    b, pc = s["batch"], s["prompt_cache"]
    budget = b["kv_budget_bytes"]
    return {
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


def _phase(row: dict[str, Any]) -> tuple[str, str | None]:
    if row["phase"] == "prefill" and row["prefill_total"]:
        done, total = row["prefill_done"], row["prefill_total"]
        return f"prefill {count(done)}/{count(total)}", bar_width(done, total)
    return row["phase"], None


def active_rows(s: dict[str, Any], now: float) -> View:
    rows = []
    for r in s["rows"]:
        phase, progress = _phase(r)
        rows.append(
            {
                "id": r["id"],
                "short_id": short_id(r["id"]),
                "api": r["api"],
                "lane": r["lane"],
                "phase": r["phase"],
                "phase_label": phase,
                "prefill_width": progress,
                "cached": count(r["cached_tokens"]) if r["cached_tokens"] else None,
                "prompt_tokens": count(r["prompt_tokens"]),
                "tokens": f"{count(r['generated_tokens'])} / {count(r['max_tokens'])}",
                "tokens_width": bar_width(r["generated_tokens"], r["max_tokens"]),
                "tps": rate(r["tokens_per_s"]),
                "age": duration(r["age_s"]),
                "kv": human_bytes(r["kv_bytes"]),
                "projected_kv": human_bytes(r["projected_kv_bytes"]),
                "constraint": r.get("constraint"),
                "output": r.get("output") if r.get("output") not in (None, "answer") else None,
            }
        )
    b = s["batch"]
    batched = sum(1 for r in s["rows"] if r["lane"] == "batch")
    return {
        "rows": rows,
        "summary": f"{b['active_rows']} running of {b['configured']}",
        "over_width": (
            f"The batch width was lowered to {b['configured']}: the {batched} batch rows "
            f"already running finish first, and no new row starts until fewer than "
            f"{b['configured']} run."
            if batched > b["configured"]
            else None
        ),
        "prefilling": b["prefilling_rows"],
        "peak": b["max_active_rows_seen"],
    }


def pending_queue(s: dict[str, Any], now: float) -> View:
    items = [
        {
            "id": p["id"],
            "short_id": short_id(p["id"]),
            "api": p["api"],
            "lane": p["lane"],
            "waited": duration(p["waited_s"]),
            "prompt_tokens": count(p["prompt_tokens"]),
            "projected_kv": human_bytes(p["projected_kv_bytes"]),
            "waiting_for": p["waiting_for"],
            "waiting_for_label": WAITING_FOR.get(p["waiting_for"], p["waiting_for"]),
        }
        for p in s["pending"]
    ]
    return {"requests": items, "summary": f"{len(items)} waiting"}


def _drain_event(d: dict[str, Any], now: float) -> View:
    is_open = d["ended_at"] is None
    paused = duration(now - d["started_at"]) + " so far" if is_open else duration(d["paused_s"])
    details = [
        ("request", short_id(d["request_id"])),
        ("rows at start", str(d["rows_at_start"])),
        ("serial wait", duration(d["serial_wait_s"])),
        ("paused for", paused),
    ]
    return {
        "kind": "drain",
        "at": d["started_at"],
        "open": is_open,
        "title": f"batch paused for {d['reason']}",
        "status": "draining" if is_open else "done",
        "details": details,
    }


def _reload_event(r: dict[str, Any], now: float) -> View:
    details = [("config version", str(r["version"]))]
    values = r.get("values") or ()
    if values:
        details += [(key, f"{old} → {new}") for key, old, new in values]
    elif r["changed"]:
        details.append(("changed", ", ".join(r["changed"])))
    if r["restart_required"]:
        details.append(("needs restart", ", ".join(r["restart_required"])))
    if r["error"]:
        details.append(("error", r["error"]))
    return {
        "kind": "reload",
        "at": r["at"],
        "open": False,
        "title": f"reload ({r['trigger']})",
        "status": r["outcome"],
        "details": details,
    }


def event_log(s: dict[str, Any], now: float, limit: int = 20) -> View:
    events = [_drain_event(d, now) for d in s["drains"]]
    events += [_reload_event(r, now) for r in s["reloads"]]
    # Open drains first, then newest first.
    events.sort(key=lambda e: (not e["open"], -e["at"]))
    for e in events:
        e["when"] = clock(e["at"])
        e["when_iso"] = iso(e["at"])
        e["ago"] = ago(e["at"], now)
    return {
        "events": events[:limit],
        "drains": len(s["drains"]),
        "reloads": len(s["reloads"]),
        "paused": s["batch"]["admission_paused"],
    }


def _nice_ceiling(x: float) -> float:
    """The smallest 1, 2 or 5 times 10^k at or above ``x`` (at least 1)."""
    if x <= 1:
        return 1.0
    magnitude = 10 ** (len(str(int(x))) - 1)
    for step in (1, 2, 5, 10):
        if x <= step * magnitude:
            return float(step * magnitude)
    return float(10 * magnitude)


def throughput(s: dict[str, Any], now: float) -> View:
    t = s["throughput"]
    # The last bucket is still filling; its rate is noise for its first second.
    series: list[float] = list(t["series"][:-1])
    top = _nice_ceiling(max(series, default=0.0))
    n = len(series)
    step = CHART_W / (n - 1) if n > 1 else CHART_W
    points = [
        (round(i * step, 1), round(CHART_H - CHART_H * min(v / top, 1.0), 1))
        for i, v in enumerate(series)
    ]
    line = " ".join(f"{x},{y}" for x, y in points)
    area = f"0,{CHART_H} {line} {CHART_W},{CHART_H}" if points else ""
    window_s = n * t["bucket_s"]
    return {
        "width": f"{CHART_W:g}",
        "height": f"{CHART_H:g}",
        "mid_y": f"{CHART_H / 2:g}",
        "line": line,
        "area": area,
        "top": f"{top:g} tok/s",
        "mid": f"{top / 2:g}",
        "window": f"last {duration(window_s)}",
        "start": f"-{duration(window_s)}",
        "bucket": f"{t['bucket_s']:g} s buckets",
        "last_minute": rate(t["last_minute_tps"]),
        # The headline: what the running rows generate right now, so it does not
        # wait for requests to finish (each row's rate since its first token).
        "now": rate(sum(r["tokens_per_s"] for r in s["rows"] if r["phase"] == "decode")),
        "decoding": sum(1 for r in s["rows"] if r["phase"] == "decode"),
        "latest": rate(series[-1]) if series else "0.0",
    }


def span(seconds: float) -> str:
    """A window's length: ``5 min`` when whole minutes, else a :func:`duration`."""
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return duration(seconds)


def ms(seconds: float | None) -> str:
    """Milliseconds for latencies: ``42 ms``, ``1,250 ms``; an em dash for none."""
    return "—" if seconds is None else f"{seconds * 1000:,.0f} ms"


def memory(s: dict[str, Any], now: float) -> View:
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
        "active_width": bar_width(m.get("active_bytes", 0), m.get("peak_bytes", 0)),
    }


def latency(s: dict[str, Any], now: float) -> View:
    lat = s.get("latency") or {}
    rows = [
        ("time to first token", "ttft"),
        ("end to end", "e2e"),
        ("inter-token", "itl"),
    ]
    return {
        "rows": [
            {
                "label": label,
                "key": key,
                "p50": ms(lat.get(f"{key}_p50_s")),
                "p95": ms(lat.get(f"{key}_p95_s")),
            }
            for label, key in rows
        ],
        "requests": count(lat.get("requests", 0)),
        "window": span(lat.get("window_s", 0)),
    }


SPARK_W = 300.0
SPARK_H = 40.0


def sparkline(values: list[float]) -> dict[str, str]:
    """SVG points for a small line chart of ``values`` (oldest first), scaled to its max."""
    top = max(values, default=0) or 1
    n = len(values)
    step = SPARK_W / (n - 1) if n > 1 else SPARK_W
    points = " ".join(
        f"{i * step:.1f},{SPARK_H - SPARK_H * min(v / top, 1.0):.1f}" for i, v in enumerate(values)
    )
    return {"points": points, "area": f"0,{SPARK_H:g} {points} {SPARK_W:g},{SPARK_H:g}"}


def history(s: dict[str, Any], now: float) -> View:
    h, t = s.get("history") or {}, s["throughput"]
    kv, waiting = list(h.get("kv_bytes") or []), list(h.get("waiting") or [])
    tps = list(t["series"])
    window = span(len(tps) * t["bucket_s"])
    lines = [
        ("kv", "KV bytes", kv, human_bytes(kv[-1] if kv else 0), human_bytes(max(kv, default=0))),
        ("queue", "waiting", waiting, count(waiting[-1] if waiting else 0),
         count(max(waiting, default=0))),
        ("tps", "tok/s", tps, rate(tps[-1] if tps else 0.0), rate(max(tps, default=0.0))),
    ]  # fmt: skip
    return {
        "width": f"{SPARK_W:g}",
        "height": f"{SPARK_H:g}",
        "window": window,
        "lines": [
            {"key": key, "label": label, "now": now_text, "max": top, **sparkline(values)}
            for key, label, values, now_text, top in lines
        ],
    }


def log_tail(s: dict[str, Any], now: float) -> View:
    entries = s.get("log_tail")
    if entries is None:
        return {"admin": False, "entries": []}
    return {
        "admin": True,
        "entries": [
            {
                "when": clock(e["at"]),
                "when_iso": iso(e["at"]),
                "ago": ago(e["at"], now),
                "level": e["level"].lower(),
                "logger": e["logger"],
                "message": e["message"],
            }
            for e in entries
        ],
    }


def counters(s: dict[str, Any], now: float) -> View:
    c, pc = s["counters"], s["prompt_cache"]
    outcomes = ("completed", "cancelled", "failed")
    lanes = []
    for lane in ("batch", "serial"):
        counts = c["requests"].get(lane, {})
        lanes.append(
            {
                "lane": lane,
                **{o: count(counts.get(o, 0)) for o in outcomes},
                "total": count(sum(counts.values())),
            }
        )
    lookups = pc["hits"] + pc["misses"]
    return {
        "lanes": lanes,
        "finished": count(c["finished"]),
        "submitted": count(c["submitted"]),
        "rejected": [(reason, count(n)) for reason, n in sorted(c["rejected"].items())],
        "rejected_total": count(sum(c["rejected"].values())),
        "lane_reasons": [(reason, count(n)) for reason, n in sorted(c["lane_reasons"].items())],
        "hit_rate": percent(pc["hits"], lookups),
        "hits": count(pc["hits"]),
        "lookups": count(lookups),
        "cached_tokens": count(pc["cached_tokens_served"]),
        "prompt_tokens": count(c["prompt_tokens"]),
        "generated_tokens": count(c["generated_tokens"]),
        "prefill_time": duration(c["prefill_seconds"]),
        "decode_time": duration(c["decode_seconds"]),
        "engine_errors": count(c["engine_errors"]),
    }


# Region id (= partial file name = refresh route) → its view function.
REGIONS: dict[str, Callable[[dict[str, Any], float], View]] = {
    "status-bar": status_bar,
    "models": models_panel,
    "kv-gauge": kv_gauge,
    "memory": memory,
    "throughput": throughput,
    "latency": latency,
    "history": history,
    "active-rows": active_rows,
    "pending-queue": pending_queue,
    "event-log": event_log,
    "counters": counters,
    "log-tail": log_tail,
    "cluster": cluster,
}


def region_view(region: str, snapshot: dict[str, Any], now: float) -> View:
    return REGIONS[region](snapshot, now)


def page_view(snapshot: dict[str, Any], now: float) -> dict[str, View]:
    """Every region's view, for the full page."""
    return {name: view(snapshot, now) for name, view in REGIONS.items()}
