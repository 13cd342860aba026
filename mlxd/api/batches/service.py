"""The Batch API as the app holds it: the store, the runner, who owns what, the numbers.

Built by :func:`mlxd.web.make_app` (the runner needs the app to run
lines through) and started on the event loop by the server. A state
directory that cannot be used (not writable, a full disk) leaves the Batch
API off with a warning: its routes answer 503, the rest of the daemon runs.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from litestar import Request

from mlxd.api.batches.runner import Runner
from mlxd.api.batches.store import BatchRow, Store
from mlxd.api.http.caller import caller_of
from mlxd.api.http.errors import OpenAIError

if TYPE_CHECKING:
    from mlxd.api.state import AppState

logger = logging.getLogger(__name__)


class BatchService:
    def __init__(self, state: AppState, app: Any):
        self.state = state
        self.root = state.settings.server.state_path / "batches"
        self.store = Store(self.root)
        self.runner = Runner(state, self.store, app)
        self.error: str | None = None

    async def start(self) -> None:
        """Open the store (setting a broken one aside) and take up the open batches."""
        try:
            self.store.open()
        except (OSError, sqlite3.Error) as exc:
            self.error = f"the batch state directory {self.root} is unusable: {exc}"
            logger.warning("%s; the Batch API is off", self.error)
            return
        await self.runner.start()

    async def stop(self) -> None:
        if self.error is None:
            await self.runner.stop()
            self.store.close()

    def counts(self, row: BatchRow) -> tuple[int, int]:
        """(completed, failed) now: the runner's for an open batch, the row's once final."""
        job = self.runner.get(row.id)
        if job is not None:
            return job.completed, job.failed
        return row.completed, row.failed

    def stats(self) -> dict[str, Any]:
        """The ``batches`` section of ``/stats``."""
        runner = self.runner
        return {
            "enabled": self.error is None,
            "error": self.error,
            "state_dir": str(self.root),
            "open_batches": len(runner.jobs),
            "queued_lines": runner.queued_lines(),
            "running_lines": runner.running_lines(),
            "lines_completed": runner.lines_done,
            "lines_failed": runner.lines_failed,
            "batches": [self.progress(job.row) for job in runner.jobs.values()],
        }

    def dashboard(self) -> dict[str, Any]:
        """What the dashboard's batches panel reads: the open batches, then the last finished."""
        if self.error is not None:
            return {"error": self.error, "open": [], "recent": [], "queued_lines": 0}
        runner = self.runner
        return {
            "error": None,
            "open": [self.progress(job.row) for job in runner.jobs.values()],
            "recent": [self.progress(row) for row in reversed(runner.recent)],
            "queued_lines": runner.queued_lines(),
            "lines_completed": runner.lines_done,
            "lines_failed": runner.lines_failed,
            "hours": self.state.settings.batches.hours,
        }

    def progress(self, row: BatchRow) -> dict[str, Any]:
        """One batch's progress for ``/stats`` and the dashboard: counts, rate, ETA."""
        completed, failed = self.counts(row)
        job = self.runner.get(row.id)
        rate = None
        eta = None
        if job is not None and job.session_done:
            elapsed = max(time.monotonic() - job.session_start, 1e-6)
            rate = job.session_done / elapsed
            left = max(row.total - completed - failed, 0)
            eta = left / rate if rate > 0 else None
        return {
            "id": row.id,
            "status": row.status,
            "endpoint": row.endpoint,
            "created_at": row.created_at,
            "total": row.total,
            "completed": completed,
            "failed": failed,
            "running": len(job.inflight) if job is not None else 0,
            "lines_per_s": rate,
            "eta_s": eta,
            "waiting_for": job.waiting_for if job is not None else None,
        }


def service(state: AppState) -> BatchService:
    """The app's Batch API, or 503 when it is off."""
    batches: BatchService | None = state.batches
    if batches is None or batches.error is not None:
        reason = batches.error if batches is not None else "it is not set up"
        raise OpenAIError(
            503, f"The Batch API is unavailable: {reason}.", code="batches_unavailable"
        )
    return batches


def owner(request: Request) -> str | None:
    """Who owns the files and batches a request creates: its API key, None without keys.

    Kept as the key's digest (:func:`~mlxd.api.http.keys.key_digest`, stable
    across restarts, unlike the Responses store's per-process HMAC). The
    batch's lines run as the key with that digest, with its name, models and
    class (:func:`~mlxd.api.http.keys.who_by_digest`).
    """
    return caller_of(request.scope).owner
