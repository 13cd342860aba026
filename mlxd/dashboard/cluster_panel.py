"""The dashboard's cluster panel: the ``cluster`` section of /stats, for people.

Only a cluster's rank 0 has that section (docs/cluster.md); on one machine
the panel is not on the page.
"""

from __future__ import annotations

from typing import Any

from mlxd.config import format_bytes
from mlxd.dashboard.formatting import Formatted

STATE_LABELS = {"forming": "forming", "ready": "in step", "peer_lost": "peer lost"}


def cluster_panel(s: dict[str, Any], now: float) -> Formatted:
    c = s.get("cluster")
    if not c:
        return {"present": False}
    ranks = []
    for r in c["ranks"]:
        age = r["last_heartbeat_age_s"]
        ranks.append(
            {
                "rank": r["rank"],
                "host": r["host"] or "?",
                "address": r["address"] or "",
                "active": format_bytes(r["active_memory_bytes"]),
                "peak": format_bytes(r["peak_memory_bytes"]),
                "heartbeat": "—" if age is None else f"{age:.1f} s ago",
                "role": "HTTP + decisions" if r["rank"] == 0 else "follows plans",
            }
        )
    return {
        "present": True,
        "state": c["state"],
        "state_label": STATE_LABELS.get(c["state"], c["state"]),
        "error": c["error"],
        "summary": f"{c['world_size']} ranks · {c['sharding']} sharding · {c['backend']}",
        "ranks": ranks,
        "steps": f"{c['steps']:,}",
        "plans": f"{c['plans']:,}",
        "comm": f"{c['comm_ms_per_step']:.2f} ms",
        "events": [{"kind": e["kind"], "message": e["message"]} for e in c["events"][:5]],
    }
