"""The dashboard's models panel: every configured model against the memory budget.

:func:`models_panel` takes the fleet's view as a dict (``FleetStatus.as_dict()``,
put in the dashboard state as ``fleet``) and returns what
``templates/partials/models.html`` shows: per model its state, what it holds
(weights, KV, prompt cache) as a stacked bar against the ``[memory] budget``,
its rows and queue, and the buttons an admin may press; one total gauge with
every model's share; the recent fleet events. Pure: values in, values out.
"""

from __future__ import annotations

from typing import Any

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

# What each memory segment is, in the order the bars stack them.
SEGMENTS = (
    ("weights", "weights"),
    ("kv", "KV claimed (what its rows hold or may grow to)"),
    ("cache", "prompt cache"),
    ("cache_cap", "prompt cache cap (reserved, not yet held)"),
)

# FleetEvent.kind, for people.
EVENT_TITLES = {
    "loaded": "loaded",
    "load_failed": "load failed",
    "unloaded": "unloaded",
    "evicted": "evicted for memory",
    "idle": "unloaded (idle)",
    "removed": "removed from the config",
    "added": "added to the config",
    "pinned": "pinned",
    "unpinned": "unpinned",
}

EVENTS_SHOWN = 12
# A finished download's row stays this long (one that failed or stopped stays).
DONE_SHOWN_S = 60.0


def _n(value: Any) -> int:
    """A count from the engine's numbers: an int, or the length of a list."""
    if isinstance(value, (list, tuple)):
        return len(value)
    return int(value or 0)


def _held(m: dict[str, Any]) -> dict[str, int]:
    """Bytes per segment: weights, KV, prompt cache held, and the rest of its cap."""
    weights = int(m["weights_bytes"] or 0)
    cache = int(m["prompt_cache_bytes"] or 0)
    # reserved = weights + the prompt cache's cap: what is left of the cap is reserved too.
    cap_rest = max(int(m["reserved_bytes"] or 0) - weights - cache, 0)
    return {
        "weights": weights,
        "kv": int(m["kv_bytes"] or 0),
        "cache": cache,
        "cache_cap": cap_rest,
    }


def _segments(model_id: str, held: dict[str, int], budget: int) -> list[Formatted]:
    return [
        {
            "kind": kind,
            "width": bar_width(held[kind], budget),
            "title": f"{model_id}: {label} {human_bytes(held[kind])}",
        }
        for kind, label in SEGMENTS
        if held[kind] > 0
    ]


def _download(m: dict[str, Any], now: float) -> Formatted | None:
    """A repo model's latest download job, for people (None: none, or done a while ago)."""
    job = m.get("download")
    if not job:
        return None
    if job["state"] == "done" and now - float(job.get("finished_at") or 0) > DONE_SHOWN_S:
        return None
    total, done = int(job["bytes_total"] or 0), int(job["bytes_done"] or 0)
    running = job["state"] == "running"
    pct = min(100, 100 * done // total) if total else 0
    if running and job["phase"] == "checking":
        detail = "checking the fit"
    else:
        detail = f"{human_bytes(done)} of {human_bytes(total)} ({pct}%)"
        if running and job.get("speed"):
            detail += f", {human_bytes(job['speed'])}/s"
        if running and job.get("eta") is not None:
            detail += f", {duration(job['eta'])} left"
    return {
        "id": job["id"],
        "state": job["state"],
        "running": running,
        "pct": pct,
        "detail": detail,
        "fit": job.get("fit"),
        "fits": job.get("fits"),
        "error": job.get("error"),
        "resumable": bool(job.get("resumable")),
    }


def _download_actions(m: dict[str, Any]) -> Formatted:
    """A repo not in the cache: Download (its fit is checked first), or Cancel while it runs."""
    job = m.get("download") or {}
    running = job.get("state") == "running"
    missing = bool(m.get("repo")) and m.get("pulled") is False
    return {
        "download": missing and not running,
        "force": missing and not running and job.get("fits") is False,
        "cancel": running,
    }


def _actions(m: dict[str, Any]) -> Formatted:
    state = m["state"]
    return {
        # A repo not in the cache cannot load: Download is its button.
        "load": state in ("unloaded", "failed") and m.get("pulled") is not False,
        # A pinned model must be unpinned first (the fleet refuses otherwise).
        "unload": state == "loaded" and not m["pinned"],
        "pin": not m["pinned"] and m.get("pulled") is not False,
        "unpin": bool(m["pinned"]),
    }


def _model(m: dict[str, Any], budget: int, now: float) -> Formatted:
    held = _held(m)
    engine = m.get("engine") or {}
    total = sum(held.values())
    caps = m.get("capabilities") or {}
    chat = m["kind"] == "chat"
    return {
        "id": m["id"],
        "kind": m["kind"],
        # A vision-language model (known once loaded): its prompts may carry images.
        "vision": bool(caps.get("vision")),
        "state": m["state"],
        "pinned": m["pinned"],
        "default": m["default"],
        "aliases": ", ".join(m.get("aliases") or ()),
        "weights": human_bytes(held["weights"]),
        "kv": human_bytes(held["kv"]),
        "cache": human_bytes(held["cache"]),
        "cache_cap": human_bytes(held["cache"] + held["cache_cap"]),
        "total": human_bytes(total),
        "total_pct": percent(total, budget),
        "segments": _segments(m["id"], held, budget),
        # A chat engine's rows and pending; another kind's engine runs and queues requests.
        "rows": count(_n(engine.get("rows" if chat else "running"))) if engine else "—",
        "queue": count(_n(engine.get("pending" if chat else "queued"))) if engine else "—",
        "served": _served(m["kind"], engine),
        "tokens_per_s": f"{float(engine['tokens_per_s']):.1f}"
        if engine.get("tokens_per_s") is not None
        else "—",
        "active": count(m["active"] or 0),
        "waiting": count(m["waiting"] or 0),
        "wait_reason": m.get("wait_reason"),
        "last_used": _last_used(m, engine, now),
        "loaded": ago(m.get("loaded_at"), now) if m.get("loaded_at") else "—",
        "load_seconds": duration(m["load_seconds"]) if m.get("load_seconds") is not None else "—",
        "keep_alive": _keep_alive(m.get("keep_alive")),
        "error": m.get("error"),
        "stalled": engine.get("stalled_reason"),
        "tools": caps.get("tools"),
        "actions": _actions(m),
        "repo": m.get("repo"),
        "revision": m.get("revision"),
        "pulled": m.get("pulled"),
        "download": _download(m, now),
        "download_actions": _download_actions(m),
    }


# What a non-chat engine's ``inputs_embedded`` counts, by kind.
_INPUTS = {"rerank": "pair", "transcription": "upload"}


def _served(kind: str, engine: dict[str, Any]) -> str:
    """A non-chat model's counts: requests served (failed) and what they carried."""
    if kind == "chat" or not engine:
        return ""
    served, failed = _n(engine.get("requests_served")), _n(engine.get("requests_failed"))
    text = f"{count(served)} served"
    if failed:
        text += f", {count(failed)} failed"
    inputs = _n(engine.get("inputs_embedded"))
    unit = _INPUTS.get(kind, "input") + ("" if inputs == 1 else "s")
    return f"{text} · {count(inputs)} {unit}"


def _last_used(m: dict[str, Any], engine: dict[str, Any], now: float) -> str:
    """ "in use" while requests hold the model (not the time the last one began)."""
    busy = _n(m.get("active")) or _n(engine.get("rows")) or _n(engine.get("pending"))
    if busy:
        return f"in use now ({count(busy)} request{'s' if busy != 1 else ''})"
    return ago(m.get("last_used"), now) if m.get("last_used") else "never"


def _keep_alive(value: Any) -> str:
    if value is None or value == "forever":
        return "forever"
    seconds = float(value)
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:.0f} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:.0f} m"
    return f"{seconds:g} s"


def _event(e: dict[str, Any], now: float) -> Formatted:
    return {
        "model": e["model"],
        "kind": e["kind"],
        "title": EVENT_TITLES.get(e["kind"], e["kind"]),
        "detail": e.get("detail") or "",
        "when": clock(e["at"]),
        "when_iso": iso(e["at"]),
        "ago": ago(e["at"], now),
    }


def models_panel(s: dict[str, Any], now: float) -> Formatted:
    """The models region; ``s["fleet"]`` is ``FleetStatus.as_dict()``, ``s["actions"]``
    the CSRF token for an admin's buttons (None: no buttons)."""
    fleet = s["fleet"]
    budget = int(fleet["budget_bytes"] or 0)
    used = int(fleet["used_bytes"] or 0)
    models = [_model(m, budget, now) for m in fleet["models"]]
    segments = [seg for v in models for seg in v["segments"]]
    events = sorted(fleet["events"], key=lambda e: -e["at"])[:EVENTS_SHOWN]
    loaded = sum(1 for m in fleet["models"] if m["state"] == "loaded")
    return {
        "models": models,
        "summary": f"{loaded} of {len(models)} loaded",
        "budget": human_bytes(budget),
        "used": human_bytes(used),
        "used_pct": percent(used, budget),
        "free": human_bytes(max(budget - used, 0)),
        "over": budget > 0 and used > budget,
        "segments": segments,
        "memory_queue": ", ".join(fleet.get("memory_queue") or ()),
        "events": [_event(e, now) for e in events],
        "csrf": s.get("actions"),
    }
