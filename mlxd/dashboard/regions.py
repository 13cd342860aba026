"""The dashboard's regions: each one's id, partial template, refresh route and formatter.

A region's id is its partial's file name (``templates/partials/<id>.html``),
its root element's ``id`` and its refresh route (``/dashboard/<id>``). Its
formatter takes the dashboard's state (``/stats`` as a dict, plus what the
HTTP side adds: :func:`mlxd.dashboard.page.dashboard_state`) and returns the
values its template places, formatted for people.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxd.dashboard import activity, charts, events, status
from mlxd.dashboard.batches_panel import batches_panel
from mlxd.dashboard.cluster_panel import cluster_panel
from mlxd.dashboard.formatting import Formatted
from mlxd.dashboard.models_panel import models_panel
from mlxd.dashboard.prompt_cache_panel import prompt_cache_panel
from mlxd.dashboard.who_panel import who_panel

Formatter = Callable[[dict[str, Any], float], Formatted]

# Region id → its formatter, in the page's order.
REGIONS: dict[str, Formatter] = {
    "status-bar": status.status_bar,
    "models": models_panel,
    "kv-gauge": status.kv_gauge,
    "memory": status.memory,
    "throughput": charts.throughput,
    "latency": charts.latency,
    "history": charts.history,
    "active-rows": activity.active_rows,
    "pending-queue": activity.pending_queue,
    "who": who_panel,
    "event-log": events.event_log,
    "counters": activity.counters,
    "batches": batches_panel,
    "prompt-cache": prompt_cache_panel,
    "log-tail": events.log_tail,
    "cluster": cluster_panel,
}


def format_region(region: str, state: dict[str, Any], now: float) -> Formatted:
    """What ``region``'s partial shows."""
    return REGIONS[region](state, now)


def format_page(state: dict[str, Any], now: float) -> dict[str, Formatted]:
    """What every region shows, for the whole page."""
    return {name: formatter(state, now) for name, formatter in REGIONS.items()}
