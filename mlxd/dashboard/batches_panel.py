"""The batches panel: each open batch's progress, rate and ETA, then the last ones to finish.

Reads what :meth:`mlxd.api.batches.service.BatchService.dashboard` gives (the
open batches in the order they run, the recently finished), plus the CSRF
token an admin's cancel buttons carry.
"""

from __future__ import annotations

from typing import Any

from mlxd.dashboard.formatting import Formatted, ago, bar_width, count, duration, percent

CANCELLABLE = ("validating", "in_progress")


def batches_panel(s: dict[str, Any], now: float) -> Formatted:
    b = s.get("batches") or {"error": "the Batch API is not set up", "open": [], "recent": []}
    return {
        "error": b.get("error"),
        "open": [_batch(x, now) for x in b["open"]],
        "recent": [_batch(x, now) for x in b["recent"]],
        "queued": count(b.get("queued_lines", 0)),
        "completed": count(b.get("lines_completed", 0)),
        "failed": count(b.get("lines_failed", 0)),
        "hours": b.get("hours"),
        "csrf": s.get("batches_csrf"),
    }


def _batch(x: dict[str, Any], now: float) -> dict[str, Any]:
    done = x["completed"] + x["failed"]
    rate = x.get("lines_per_s")
    return {
        "id": x["id"],
        "status": x["status"],
        "endpoint": x["endpoint"],
        "created": ago(x["created_at"], now),
        "done": count(done),
        "total": count(x["total"]),
        "completed": count(x["completed"]),
        "failed": count(x["failed"]),
        "running": count(x.get("running", 0)),
        "pct": percent(done, x["total"]) if x["total"] else "—",
        "width": bar_width(done, x["total"]) if x["total"] else "0%",
        "rate": f"{rate:.2f} lines/s" if rate else "—",
        "eta": duration(x["eta_s"]) if x.get("eta_s") is not None else "—",
        "waiting_for": x.get("waiting_for"),
        "cancellable": x["status"] in CANCELLABLE,
    }
