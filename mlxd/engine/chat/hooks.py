"""What the chat engine asks of the machines it runs on: the cluster hooks, and one machine's.

The engine thread calls these few hooks and nothing else of a cluster:
:class:`OneMachine` is the default (load the model here, step alone), and
rank 0 of a cluster passes :class:`~mlxd.engine.cluster.hooks.LeaderHooks`,
which joins the group, loads its shard, broadcasts each step through
mirrored lanes and ends the engine when a peer is lost (docs/cluster.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from mlxd.config import BatchSettings, ModelSettings, PromptCacheSettings, Settings
from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.loading import LoadedModel, load_model
from mlxd.engine.chat.prompt_cache import PromptCache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.serial import OnCheckpoint, SerialRun
from mlxd.engine.cluster_status import ClusterStatus
from mlxd.engine.messages import Failed

# Ends every request with the value and shows it as the engine's state (any thread).
Halt = Callable[[Failed], None]


class ClusterHooks(Protocol):
    """The calls the chat engine makes to whatever it runs on (one machine or a cluster)."""

    @property
    def heartbeat_s(self) -> float:
        """The longest the idle engine thread may wait before :meth:`idle` runs again."""
        ...

    @property
    def checkpoints(self) -> bool:
        """Whether prefills keep prompt-cache checkpoints (every rank must cut alike)."""
        ...

    @property
    def disk_tier(self) -> bool:
        """Whether the prompt cache may keep entries on this machine's disk."""
        ...

    def run(self, serve: Callable[[], None], halt: Halt) -> None:
        """Run the engine thread's body; if the machines cannot go on, ``halt`` the engine."""
        ...

    def join(self, settings: Settings, *, optimized_blas: bool) -> None:
        """Before the first load: join the other machines (raises when they cannot)."""
        ...

    def load(self, model: ModelSettings, *, optimized_blas: bool, generation: int) -> LoadedModel:
        """Load ``model`` (a cluster: every rank its shard); raises ``ModelLoadError``."""
        ...

    def first_load_done(self, error: str | None) -> None:
        """The first load is over (``error`` when it failed); raises when that ends the engine."""
        ...

    def idle(self) -> None:
        """A pass of the engine loop ran no step (a cluster sends its heartbeat)."""
        ...

    def make_batch_lane(
        self, loaded: LoadedModel, settings: BatchSettings, *, faults: bool
    ) -> BatchLane:
        """The batch lane for ``loaded``."""
        ...

    def make_serial_run(
        self,
        loaded: LoadedModel,
        row: Row,
        cache: list[Any] | None,
        rest: list[int],
        *,
        prefill_step_size: int,
        pump: Callable[[], None],
        faults: bool,
        on_checkpoint: OnCheckpoint | None = None,
    ) -> SerialRun:
        """The serial run of ``row``, from ``cache`` with ``rest`` left to prefill."""
        ...

    def make_prompt_cache(
        self, settings: PromptCacheSettings, batch: Callable[[], BatchSettings]
    ) -> PromptCache:
        """The prompt cache; ``batch`` reads the live batch settings."""
        ...

    def state(self, engine_state: str) -> str:
        """The state the snapshot shows, given the engine's own."""
        ...

    def status(self) -> ClusterStatus | None:
        """The snapshot's ``cluster`` section; None on one machine."""
        ...

    def shutdown(self) -> None:
        """The engine thread is about to exit."""
        ...


class OneMachine:
    """The hooks of an engine alone on this machine: load here, step alone, never lost."""

    heartbeat_s = math.inf
    checkpoints = True
    disk_tier = True
    # Rows may yield to more urgent ones ([scheduling] preempt); a cluster's may not.
    preemption = True

    def run(self, serve: Callable[[], None], halt: Halt) -> None:
        serve()

    def join(self, settings: Settings, *, optimized_blas: bool) -> None:
        return None

    def load(self, model: ModelSettings, *, optimized_blas: bool, generation: int) -> LoadedModel:
        return load_model(model, optimized_blas=optimized_blas, generation=generation)

    def first_load_done(self, error: str | None) -> None:
        return None

    def idle(self) -> None:
        return None

    def make_batch_lane(
        self, loaded: LoadedModel, settings: BatchSettings, *, faults: bool
    ) -> BatchLane:
        return BatchLane(loaded, settings, faults=faults)

    def make_serial_run(
        self,
        loaded: LoadedModel,
        row: Row,
        cache: list[Any] | None,
        rest: list[int],
        *,
        prefill_step_size: int,
        pump: Callable[[], None],
        faults: bool,
        on_checkpoint: OnCheckpoint | None = None,
    ) -> SerialRun:
        return SerialRun(
            loaded,
            row,
            cache,
            rest,
            prefill_step_size=prefill_step_size,
            pump=pump,
            faults=faults,
            on_checkpoint=on_checkpoint,
        )

    def make_prompt_cache(
        self, settings: PromptCacheSettings, batch: Callable[[], BatchSettings]
    ) -> PromptCache:
        return PromptCache(settings)

    def state(self, engine_state: str) -> str:
        return engine_state

    def status(self) -> ClusterStatus | None:
        return None

    def shutdown(self) -> None:
        return None
