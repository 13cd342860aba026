"""The event log (drains, preemptions and reloads) and the log tail."""

from __future__ import annotations

from typing import Any

from mlxd.dashboard.formatting import Formatted, ago, clock, duration, iso, short_id


def _drain_event(d: dict[str, Any], now: float) -> Formatted:
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


def _reload_event(r: dict[str, Any], now: float) -> Formatted:
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


def _preemption_event(p: dict[str, Any], now: float) -> Formatted:
    return {
        "kind": "preemption",
        "at": p["at"],
        "open": False,
        "title": f"{p['priority']} row yielded to a {p['by_priority']} request",
        "status": "resumes",
        "details": [
            ("request", short_id(p["request_id"])),
            ("key", p["key"] or "-"),
            ("after", f"{p['generated_tokens']} tokens"),
            ("for", short_id(p["by_request_id"])),
        ],
    }


def event_log(s: dict[str, Any], now: float, limit: int = 20) -> Formatted:
    events = [_drain_event(d, now) for d in s["drains"]]
    events += [_preemption_event(p, now) for p in s.get("preemptions") or ()]
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


def log_tail(s: dict[str, Any], now: float) -> Formatted:
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
