"""The daemon's config version and its log of reload attempts.

They belong to the daemon, not to any model's engine: a reload may add,
remove or swap every model, and move ``default`` to another one. The reload
path (:mod:`mlxd.api.reload`) swaps a new :class:`ReloadLog` into
``AppState.reload_log`` after each attempt, on the event loop; ``/stats``,
``/metrics``, the dashboard and ``mlxd status`` read the current one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

KEPT = 32  # reload events kept, newest first


@dataclass(frozen=True)
class AppliedConfig:
    """The running config: its version (1 at start, +1 per reload that applied something)."""

    version: int
    applied_at: float
    source: str | None  # the config file, None without one


@dataclass(frozen=True)
class ReloadEvent:
    """One reload attempt: what triggered it, what changed, what happened."""

    id: int
    trigger: str
    at: float
    outcome: str  # applied | unchanged | restart_required | rejected | failed | partial
    changed: tuple[str, ...] = ()
    restart_required: tuple[str, ...] = ()
    error: str | None = None
    version: int = 0
    # (key, old, new) as text, secrets masked: what the event log shows.
    values: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class ReloadLog:
    """The applied config and the last :data:`KEPT` reload attempts (an immutable value)."""

    config: AppliedConfig
    events: tuple[ReloadEvent, ...] = ()  # newest first
    attempts: int = 0  # every attempt since start; the id of the latest

    @classmethod
    def start(cls, source: str | None, at: float | None = None) -> ReloadLog:
        """Version 1, applied ``at`` (now), from ``source``; no attempt yet."""
        return cls(AppliedConfig(1, time.time() if at is None else at, source))

    def next_version(self, applied: bool) -> int:
        """The config version after an attempt that ``applied`` something, or not."""
        return self.config.version + (1 if applied else 0)

    def record(self, event: ReloadEvent, *, applied: bool) -> ReloadLog:
        """This log with ``event`` as the newest attempt (and a new version if ``applied``)."""
        config = self.config
        if applied:
            config = AppliedConfig(event.version, event.at, config.source)
        return ReloadLog(config, (event, *self.events)[:KEPT], event.id)

    def as_dict(self) -> dict[str, Any]:
        """The ``config`` and ``reloads`` fields of ``GET /stats`` (docs/api.md)."""
        return {"config": asdict(self.config), "reloads": [asdict(e) for e in self.events]}
