"""The "who" panel: each API key's load, quota use and preemptions (``/stats`` ``keys``)."""

from __future__ import annotations

from typing import Any

from mlxd.dashboard.formatting import Formatted, bar_width, count


def _quota(used: int, limit: int) -> tuple[str, str | None]:
    """``used`` against ``limit`` for people, and a bar width when there is a limit."""
    if not limit:
        return count(used), None
    return f"{count(used)} / {count(limit)}", bar_width(used, limit)


def who_panel(s: dict[str, Any], now: float) -> Formatted:
    keys = []
    for k in s.get("keys") or []:
        tokens, tokens_width = _quota(k["tokens_last_minute"], k["tokens_per_minute"])
        requests, requests_width = _quota(k["requests_last_minute"], k["requests_per_minute"])
        keys.append(
            {
                "name": k["name"],
                "priority": k["priority"],
                "models": ", ".join(k["models"]) or "every model",
                "running": count(k["running"]),
                "waiting": count(k["waiting"]),
                "concurrent": (
                    f"{count(k['in_flight'])} / {count(k['max_concurrent'])}"
                    if k["max_concurrent"]
                    else None
                ),
                "tokens": tokens,
                "tokens_width": tokens_width,
                "requests": requests,
                "requests_width": requests_width,
                "preemptions": count(k["preemptions"]),
                "refused": count(k["refused"]) if k["refused"] else None,
            }
        )
    total = s["counters"].get("preemptions", 0)
    return {
        "who": keys,  # not "keys": Jinja would find the dict's method
        "summary": f"{len(keys)} API keys" if keys else "no API keys: /v1 is open",
        "preemptions": count(total) if total else None,
    }
