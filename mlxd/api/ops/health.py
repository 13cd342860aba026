"""Liveness and readiness for supervisors (systemd, launchd, load balancers)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Response, get, head

from mlxd.api.http.errors import without_paths
from mlxd.api.state import Mlxd


@head("/", include_in_schema=False, status_code=200)
async def root_probe() -> None:
    """``HEAD /``: 200, for clients that probe the server before they start (Claude Code)."""


class HealthController(Controller):
    @get("/health")
    async def health(self, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """Liveness: the process answers and every engine thread is running."""
        alive = all(engine.alive for engine in mlxd.fleet.engines())
        body = {"status": "ok" if alive else "engine_dead"}
        return Response(body, status_code=200 if alive else 503)

    @get("/ready")
    async def ready(self, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """Readiness: pinned models are loaded, engines step and admit, the server takes requests.

        A model loaded on demand (not pinned) does not make the daemon unready
        while it is unloaded: a request for it loads it. Loaded models whose
        reservations fill ``[memory] budget`` (pinned or busy ones after a lowered
        budget) do: no request could be admitted.
        """
        snap = mlxd.engine.snapshot()
        now = time.time()
        cluster = snap.cluster
        view = mlxd.fleet.status()
        snapshots = mlxd.fleet.snapshots()
        waiting = next((m for m in view.models if m.pinned and m.state != "loaded"), None)
        stalled = next((i for i, s in snapshots.items() if s.stalled(now)), None)
        if cluster is not None and cluster.state != "ready":
            reason = f"cluster {cluster.state}: {cluster.error or 'waiting for ranks'}"
        elif mlxd.shutting_down or snap.state == "stopping":
            reason = "shutting down"
        elif not all(engine.alive for engine in mlxd.fleet.engines()):
            reason = "an engine thread is not running"
        elif waiting is not None:
            own = snapshots.get(waiting.id)
            reason = waiting.error or (
                f"engine is {own.state}" if own is not None else f"{waiting.id} is {waiting.state}"
            )
        elif stalled is not None:
            reason = f"engine {stalled} stalled: {snapshots[stalled].stalled_reason(now)}"
        elif view.over_budget is not None:
            reason = view.over_budget
        else:
            default = next((m.id for m in view.models if m.default and m.kind == "chat"), None)
            models = {m.id: m.state for m in view.models}
            return Response(
                {"status": "ready", "model": default, "models": models}, status_code=200
            )
        # Supervisors and load balancers read this unauthenticated: no server paths
        # (the full reason is in /stats and the log).
        body = {"status": "not_ready", "reason": without_paths(reason)}
        return Response(body, status_code=503)
