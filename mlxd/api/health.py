"""Liveness and readiness for supervisors (systemd, launchd, load balancers)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Response, get
from litestar.di import Provide

from mlxd.api.state import Mlxd, provide_app_state


class HealthController(Controller):
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}

    @get("/health")
    async def health(self, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """Liveness: the process answers and the engine thread is running."""
        alive = mlxd.engine.alive
        body = {"status": "ok" if alive else "engine_dead"}
        return Response(body, status_code=200 if alive else 503)

    @get("/ready")
    async def ready(self, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """Readiness: a model is loaded, the engine steps, and the server takes requests."""
        snap = mlxd.engine.snapshot()
        now = time.time()
        cluster = snap.cluster or {}
        if cluster.get("state") not in (None, "ready"):
            reason = f"cluster {cluster['state']}: {cluster.get('error') or 'waiting for ranks'}"
        elif mlxd.shutting_down or snap.state == "stopping":
            reason = "shutting down"
        elif not mlxd.engine.alive:
            reason = "the engine thread is not running"
        elif snap.state != "ready":
            reason = snap.model.error or f"engine is {snap.state}"
        elif snap.stalled(now):
            reason = f"engine stalled: no step finished for {now - snap.last_step_at:.0f}s"
        else:
            return Response({"status": "ready", "model": snap.model.name}, status_code=200)
        return Response({"status": "not_ready", "reason": reason}, status_code=503)
