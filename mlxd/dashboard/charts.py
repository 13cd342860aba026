"""The throughput chart, the sparklines and the latency table: SVG points and percentiles."""

from __future__ import annotations

from typing import Any

from mlxd.dashboard.formatting import Formatted, count, duration, human_bytes, rate

CHART_W = 600.0
CHART_H = 120.0
SPARK_W = 300.0
SPARK_H = 40.0


def _nice_ceiling(x: float) -> float:
    """The smallest 1, 2 or 5 times 10^k at or above ``x`` (at least 1)."""
    if x <= 1:
        return 1.0
    magnitude = 10 ** (len(str(int(x))) - 1)
    for step in (1, 2, 5, 10):
        if x <= step * magnitude:
            return float(step * magnitude)
    return float(10 * magnitude)


def throughput(s: dict[str, Any], now: float) -> Formatted:
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
        **every_model(s),
    }


def every_model(s: dict[str, Any]) -> Formatted:
    """With several chat models: which one the chart and the headline show, and a row
    per loaded chat model (running, waiting, tok/s, KV) with their totals."""
    models = [m for m in (s.get("fleet") or {}).get("models", []) if m["kind"] == "chat"]
    name = s["model"]["name"] or "—"
    if len(models) < 2:
        return {"several": False, "scope": name}
    rows = []
    for m in models:
        e = m.get("engine") or {}
        rows.append(
            {
                "id": m["id"],
                "default": m["default"],
                "state": m["state"],
                "running": count(e.get("rows", 0)),
                "waiting": count(e.get("pending", 0) + (m.get("waiting") or 0)),
                "tps": rate(float(e.get("tokens_per_s") or 0.0)),
                "kv": human_bytes(e.get("kv_bytes", 0)),
                "kv_budget": human_bytes(e.get("kv_budget_bytes", 0)),
            }
        )
    engines = [m.get("engine") or {} for m in models]
    return {
        "several": True,
        "scope": f"model {name} (default)",
        "models": rows,
        "all_running": count(sum(e.get("rows", 0) for e in engines)),
        "all_waiting": count(
            sum(e.get("pending", 0) for e in engines) + sum(m.get("waiting") or 0 for m in models)
        ),
        "all_tps": rate(sum(float(e.get("tokens_per_s") or 0.0) for e in engines)),
    }


def span(seconds: float) -> str:
    """A window's length: ``5 min`` when whole minutes, else a :func:`duration`."""
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return duration(seconds)


def ms(seconds: float | None) -> str:
    """A latency for people: ``42 ms``, ``1,250 ms``, from 10 s in seconds (``46.5 s``,
    not ``46,456 ms``); an em dash for none."""
    if seconds is None:
        return "—"
    if seconds >= 10:
        return f"{seconds:,.1f} s"
    return f"{seconds * 1000:,.0f} ms"


def latency(s: dict[str, Any], now: float) -> Formatted:
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


def sparkline(values: list[float]) -> dict[str, str]:
    """SVG points for a small line chart of ``values`` (oldest first), scaled to its max."""
    top = max(values, default=0) or 1
    n = len(values)
    step = SPARK_W / (n - 1) if n > 1 else SPARK_W
    points = " ".join(
        f"{i * step:.1f},{SPARK_H - SPARK_H * min(v / top, 1.0):.1f}" for i, v in enumerate(values)
    )
    return {"points": points, "area": f"0,{SPARK_H:g} {points} {SPARK_W:g},{SPARK_H:g}"}


def history(s: dict[str, Any], now: float) -> Formatted:
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
