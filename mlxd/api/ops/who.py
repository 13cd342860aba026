"""Who is using the daemon: each API key's load, quota use and preemptions.

The ``keys`` section of ``/stats`` (docs/api.md), the dashboard's "who"
panel, ``mlxd status`` and the ``key``-labelled metrics all read this one
value: per configured key (by name, never its secret), its rules, the rows
it has running and waiting across every chat model, its rolling-minute
counts (:mod:`mlxd.api.quotas`) and how often its rows yielded.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from mlxd.api.http.keys import identities
from mlxd.api.state import AppState


def keys_stats(state: AppState) -> list[dict[str, Any]]:
    """``/stats`` ``keys``: one object per configured key, in the config's order."""
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    preempted: dict[str, int] = {}
    for snapshot in state.fleet.snapshots().values():
        for row in snapshot.rows:
            if row.key:
                running[row.key] = running.get(row.key, 0) + 1
        for item in snapshot.pending:
            if item.key:
                waiting[item.key] = waiting.get(item.key, 0) + 1
        for key, n in snapshot.counters.get("preemptions_by_key", {}).items():
            preempted[key] = preempted.get(key, 0) + n
    out: list[dict[str, Any]] = []
    for _, who in identities(state.settings):
        out.append(
            {
                "name": who.name,
                "priority": who.priority,
                "models": list(who.models),
                "requests_per_minute": who.requests_per_minute,
                "tokens_per_minute": who.tokens_per_minute,
                "max_concurrent": who.max_concurrent,
                "running": running.get(who.name, 0),
                "waiting": waiting.get(who.name, 0),
                "preemptions": preempted.get(who.name, 0),
                **asdict(state.quotas.usage(who.name)),
            }
        )
    return out
