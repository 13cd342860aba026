"""One machine's serving state, assembled from its settings: engines, fleet and :class:`AppState`.

What :mod:`mlxd.server` runs in a process and what the tests run in process
(``tests/support/inprocess.py``) alike; the roles, signals and the socket stay
in the server.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxd.api.ops.metrics import install_metrics
from mlxd.api.ops.recent import install_recent
from mlxd.api.state import AppState
from mlxd.config import Settings
from mlxd.dashboard import logtail
from mlxd.engine.chat.engine import Engine

if TYPE_CHECKING:
    from mlxd.engine.cluster.leader import Leader
    from mlxd.engine.embeddings.engine import EmbeddingEngine
    from mlxd.engine.memory import MemoryPool

logger = logging.getLogger(__name__)


def runtime_info() -> dict[str, Any]:
    """What the process actually runs on (read after MLX is loaded)."""
    from mlxd.engine.chat.loading import device_name
    from mlxd.runtime.blas import mapped_blas

    info = mapped_blas()
    return {
        "device": device_name(),
        "blas": info.name,
        "blas_path": info.path,
        "blas_optimized": info.optimized,
        "blas_threads": info.threads,
        "pid": os.getpid(),
    }


def faults_enabled() -> bool:
    """Whether requests may inject faults (tests only): ``MLXD_FAULT_INJECTION=1``."""
    return os.environ.get("MLXD_FAULT_INJECTION") == "1"


class EngineFactory:
    """How the fleet builds each model's engine, from what every engine shares."""

    def __init__(
        self,
        runtime: dict[str, Any],
        *,
        faults: bool,
        leader: Leader | None,
    ):
        self.runtime = runtime
        self.optimized_blas = bool(runtime["blas_optimized"])
        self.faults = faults
        self.leader = leader
        # Set once the app state exists, before any engine can lose a cluster.
        self.state: AppState | None = None

    def chat(self, settings: Settings, model_id: str, pool: MemoryPool, at_start: bool) -> Engine:
        hooks = None
        if self.leader is not None:
            from mlxd.engine.cluster.hooks import LeaderHooks

            hooks = LeaderHooks(self.leader, on_fatal=self.cluster_lost)
        return Engine(
            settings,
            optimized_blas=self.optimized_blas,
            fault_injection=self.faults,
            runtime=self.runtime,
            cluster=hooks,
            pool=pool,
            model_id=model_id,
            load_at_start=at_start,
        )

    def embedding(self, settings: Settings, model_id: str) -> EmbeddingEngine:
        from mlxd.engine.embeddings.engine import EmbeddingEngine

        return EmbeddingEngine(settings, model_id, optimized_blas=self.optimized_blas)

    def cluster_lost(self, message: str, code: int) -> None:
        """Refuse new requests, let the error events flush, exit ``code``.

        A supervisor (systemd, launchd) then restarts the group; no
        collective can be trusted again in this process.
        """
        from mlxd.engine.cluster.watchdog import leave_soon

        if self.state is not None:
            self.state.shutting_down = True
        leave_soon(message, code, grace_s=1.0)


def build_state(
    settings: Settings,
    runtime: dict[str, Any],
    *,
    config_path: Path | None,
    overrides: dict[str, Any],
    faults: bool,
    leader: Leader | None = None,
) -> AppState:
    """The fleet (engines not started yet) and the app state around it, observers installed.

    Start the fleet with ``state.fleet.start()``; stop it with ``state.fleet.stop()``.
    """
    from mlxd.engine.chat.loading import device_memory_bytes
    from mlxd.engine.fleet.fleet import Fleet

    engines = EngineFactory(runtime, faults=faults, leader=leader)
    fleet = Fleet(
        settings,
        device_bytes=device_memory_bytes(),
        make_engine=engines.chat,
        make_embedding=engines.embedding,
    )
    state = AppState(
        fleet=fleet,
        settings=settings,
        config_path=config_path,
        overrides=overrides,
        fault_injection=faults,
    )
    engines.state = state
    install_metrics(state)
    install_recent(state)
    logtail.install()
    return state
