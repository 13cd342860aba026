"""Rank 0's hooks into its chat engine: join, load shards, mirror steps, end when a peer is lost.

The chat engine knows nothing of a cluster but the hooks it calls
(:class:`~mlxd.engine.chat.hooks.ClusterHooks`); :class:`LeaderHooks`
answers them over rank 0's :class:`~mlxd.engine.cluster.leader.Leader`:
it joins the group before the first load, loads every rank's shard
together, hands the engine mirrored lanes and prompt cache that broadcast
each step, sends the heartbeat when there is nothing to do, and, when the
cluster is lost (a collective failed on the engine thread, or the watchdog
fired on its own), halts the engine and ends the process through
``on_fatal`` (docs/cluster.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from mlxd.config import BatchSettings, ModelSettings, PromptCacheSettings, Settings
from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.hooks import Halt
from mlxd.engine.chat.loading import LoadedModel, load_model
from mlxd.engine.chat.prompt_cache import PromptCache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.serial import OnCheckpoint, SerialRun
from mlxd.engine.cluster.join import ClusterError
from mlxd.engine.cluster.leader import Leader
from mlxd.engine.cluster.plan import PeerLost
from mlxd.engine.cluster.start import check_model, shard_loader, start_leader
from mlxd.engine.cluster.watchdog import HEARTBEAT_S
from mlxd.engine.cluster_status import ClusterStatus
from mlxd.engine.messages import Failed

logger = logging.getLogger(__name__)


class LeaderHooks:
    """The chat engine's hooks on rank 0 of a cluster.

    Args:
        leader: Rank 0's side of the cluster.
        on_fatal: Ends the process with ``(message, exit code)`` once the
            cluster is lost (3), or could not form (2).
    """

    heartbeat_s = HEARTBEAT_S
    # Every rank would have to cut its prefills alike and store the same
    # checkpoints; a cluster keeps finished rows only, and RAM only (docs/cluster.md).
    checkpoints = False
    disk_tier = False

    def __init__(self, leader: Leader, *, on_fatal: Callable[[str, int], None]):
        self._leader = leader
        self._on_fatal = on_fatal
        self._halt: Halt = lambda failed: None
        self._lost = False
        self._lock = threading.Lock()
        leader.on_fatal = self._cluster_lost  # the watchdog, from its own thread

    def run(self, serve: Callable[[], None], halt: Halt) -> None:
        self._halt = halt
        try:
            serve()
        except PeerLost as exc:
            self._cluster_lost(str(exc))
        except ClusterError as exc:  # refused at startup: the group cannot form
            logger.error("cluster: %s", exc)
            self._cluster_lost(str(exc), code=2)
        except Exception as exc:  # outside the engine loop: rank 0 cannot lead any more
            logger.exception("cluster: rank 0's engine failed")
            formed = self._leader.state == "ready"
            self._cluster_lost(f"rank 0's engine failed: {exc!r}", code=3 if formed else 2)

    def join(self, settings: Settings, *, optimized_blas: bool) -> None:
        start_leader(self._leader, settings, optimized_blas=optimized_blas)

    def load(self, model: ModelSettings, *, optimized_blas: bool, generation: int) -> LoadedModel:
        leader = self._leader
        # A registry entry's own keys (kind, pin, overrides) stay on rank 0.
        model = ModelSettings(**model.model_dump(include=set(ModelSettings.model_fields)))
        check_model(leader, model, optimized_blas=optimized_blas)
        leader.load(model.model_dump(), generation)
        try:
            return load_model(
                model,
                optimized_blas=optimized_blas,
                generation=generation,
                loader=shard_loader(leader),
            )
        except Exception as exc:  # the other ranks are loading: no way back
            raise leader.lost(f"rank 0 could not load its shard: {exc}") from exc

    def first_load_done(self, error: str | None) -> None:
        if error is not None:  # the other ranks cannot serve without rank 0
            raise ClusterError(error)

    def idle(self) -> None:
        self._leader.heartbeat()

    def make_batch_lane(
        self, loaded: LoadedModel, settings: BatchSettings, *, faults: bool
    ) -> BatchLane:
        return self._leader.batch_lane(loaded, settings, faults=faults)

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
        # No checkpoints in a cluster (see ``checkpoints`` above): on_checkpoint stays unused.
        return self._leader.serial_run(
            loaded, row, cache, rest, prefill_step_size=prefill_step_size, pump=pump, faults=faults
        )

    def make_prompt_cache(
        self, settings: PromptCacheSettings, batch: Callable[[], BatchSettings]
    ) -> PromptCache:
        return self._leader.prompt_cache(settings, batch)

    def state(self, engine_state: str) -> str:
        state = self._leader.state
        if state == "peer_lost":
            return "peer_lost"
        return engine_state if state == "ready" else "starting"

    def status(self) -> ClusterStatus | None:
        return self._leader.status()

    def shutdown(self) -> None:
        self._leader.shutdown()

    def _cluster_lost(self, message: str, code: int = 3) -> None:
        """The cluster cannot go on: fail every request, go not-ready, let the server exit.

        Runs on the engine thread (a collective raised) or on the watchdog's
        thread (the engine thread is stuck in a collective).
        """
        with self._lock:
            if self._lost:
                return
            self._lost = True
        leader = self._leader
        leader.lost(message)
        message = leader.error or message
        self._halt(Failed("peer_lost", f"the cluster lost a rank: {message}", 503))
        self._on_fatal(message, code)
