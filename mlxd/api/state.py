"""What the HTTP side holds: the fleet, the settings, the reload log, the lifecycle flags."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from litestar.datastructures import State
from litestar.di import NamedDependency

from mlxd.api.quotas import Quotas
from mlxd.api.reload_log import ReloadLog
from mlxd.api.responses.store import ResponseStore
from mlxd.config import Settings

if TYPE_CHECKING:
    from mlxd.engine import Accepted, Engine, Failed, Finished, Fleet

# Called once per request that the engine accepted, when it ends.
Observer = Callable[["Accepted", "Finished | Failed"], None]


class AppState:
    """Shared by every handler; ``settings`` and ``reload_log`` are swapped whole, never mutated.

    A plain class on purpose: Litestar would try to validate a dataclass
    dependency field by field.
    """

    def __init__(
        self,
        fleet: Fleet,
        settings: Settings,
        *,
        config_path: Path | None = None,
        overrides: dict[str, Any] | None = None,
        fault_injection: bool = False,
    ):
        self.fleet = fleet
        self.settings = settings
        self.config_path = config_path
        self.overrides = overrides or {}
        self.fault_injection = fault_injection
        self.shutting_down = False
        self.started_at = time.time()
        # The config version and the reload attempts: the daemon's, whichever model is default.
        self.reload_log = ReloadLog.start(
            str(config_path) if config_path else None, self.started_at
        )
        self.observers: list[Observer] = []
        # Responses kept for previous_response_id and GET /v1/responses/{id}.
        self.responses = ResponseStore(lambda: self.settings.responses)
        # Called with (seconds, cached) for each grammar prepared for a request.
        self.compile_observers: list[Callable[[float, bool], None]] = []
        # SIGHUP, /admin/reload and the editor never reload at the same time.
        self.reload_lock = asyncio.Lock()
        # The Batch API's BatchService (set by make_app, started by the server); None in
        # bare test apps. Typed loosely: mlxd.api.batches imports this module.
        self.batches: Any = None
        # The hub download jobs (mlxd.api.ops.downloads.DownloadService, set by make_app).
        self.downloads: Any = None
        # Each API key's rolling-minute counts; they outlive reloads, not restarts.
        self.quotas = Quotas()

    @property
    def engine(self) -> Engine:
        """The default chat model's engine: what the top of /stats and the dashboard show."""
        return self.fleet.primary()

    def observe(self, accepted: Accepted, outcome: Finished | Failed) -> None:
        """Tell observers (e.g. /metrics histograms) how an accepted request ended."""
        for observer in self.observers:
            observer(accepted, outcome)


def provide_app_state(state: State) -> AppState:
    return state.mlxd


# How handlers ask for the app state: ``mlxd: Mlxd``.
Mlxd = NamedDependency[AppState]
