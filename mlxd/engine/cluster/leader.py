"""Rank 0 of a cluster: the op log, the plans and digests, and the view of the group.

The engine core runs unchanged on rank 0; its batch lane, serial lane and
prompt cache are replaced by the mirrored versions (:mod:`.mirrored`),
which record each MLX-side operation (:mod:`.plan`) into the
:class:`Leader`'s log and, right before the model runs (a batch step or a
serial token), have it broadcast the plan so the other ranks apply the
same operations and run the same step. A collective that fails, a digest
that disagrees, or a step longer than ``step_timeout`` (the
:class:`~.watchdog.Watchdog`) ends the cluster: :class:`~.plan.PeerLost`
on the engine thread, ``on_fatal`` from the watchdog.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mlxd.config import BatchSettings, ClusterSettings, PromptCacheSettings
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.prompt_cache import PromptCache
from mlxd.engine.chat.serial import SerialRun
from mlxd.engine.cluster.join import Membership
from mlxd.engine.cluster.links import Links
from mlxd.engine.cluster.mirrored import (
    MirroredBatchLane,
    MirroredPromptCache,
    MirroredSerialRun,
)
from mlxd.engine.cluster.plan import (
    Collectives,
    Configure,
    Digest,
    Load,
    Op,
    PeerLost,
    Plan,
    Run,
    Seed,
    Shutdown,
    TokenChecksum,
    compare_digests,
    encode_plan,
    local_digest,
)
from mlxd.engine.cluster.watchdog import EXIT_LOST, HEARTBEAT_S, Watchdog
from mlxd.engine.cluster_status import ClusterEvent, ClusterState, ClusterStatus, RankStatus

logger = logging.getLogger(__name__)

# The ranks compare digests every this many plans.
DIGEST_EVERY = 8


class Leader:
    """Rank 0's side of the cluster: the op log, plans, digests, watchdog and view."""

    def __init__(self, settings: ClusterSettings, member: Membership):
        self.settings = settings
        self.member = member
        self.sharding = settings.sharding
        self.collectives: Collectives | None = None
        self.ops: list[Op] = []
        self.seq = 0
        self.checksum = TokenChecksum()
        self.state: ClusterState = "forming"
        self.error: str | None = None
        self.hosts: list[str] = []
        # Every rank's digest from the last exchange, by rank (memory for the view).
        self.digests: list[Digest] = []
        self.last_contact = time.time()
        self.last_sync_mono = 0.0
        self.digest_pending = False
        self.comm_seconds = 0.0
        # The part of comm_seconds spent on plans that ran a step.
        self.step_comm_seconds = 0.0
        self.comm_plans = 0
        self.plan_bytes = 0
        self.events: deque[ClusterEvent] = deque(maxlen=16)
        self.links = Links()
        self.watchdog = Watchdog(
            settings.step_timeout,
            self.fatal,
            waiting="a step has waited on the other ranks",
            culprit="a peer",
            probe=self.links.closed,
        )
        # Set by whoever runs the process (the server): ends it, non-zero.
        self.on_fatal: Callable[[str, int], None] = lambda message, code: None
        self._fatal_lock = threading.Lock()
        self._fatal_sent = False

    # ------------------------------------------------------------ start

    def join(self, group: Any, batch: BatchSettings, cache: PromptCacheSettings) -> None:
        """After ``init``: learn every rank's host, seed MLX and send the live settings."""
        import mlx.core as mx

        self.collectives = Collectives(group)
        self.links.find(self.member.endpoints, self.collectives.rank)
        self.hosts = self.collectives.gather_text(socket.gethostname())
        seed = secrets.randbits(31)
        mx.random.seed(seed)
        self.record(Seed(seed))
        self.configure(batch, cache)
        self.state = "ready"
        self.last_contact = time.time()
        self.event("joined", f"{self.collectives.size} ranks: {', '.join(self.hosts)}")

    def watch(self) -> None:
        """Start the watchdog: a step longer than ``step_timeout`` ends the cluster."""
        self.watchdog.start()

    def configure(self, batch: BatchSettings, cache: PromptCacheSettings) -> None:
        self.record(Configure(batch.model_dump(), cache.model_dump(mode="json")))

    def load(self, model: dict[str, Any], generation: int) -> None:
        """Tell every rank to load ``model`` now; call right before loading it here."""
        self.record(Load(model, generation, self.sharding))
        self.sync("")

    def shutdown(self) -> None:
        """The last plan: every rank exits 0 after it."""
        if self.collectives is None or self.state != "ready":
            return
        self.record(Shutdown())
        try:
            self.sync("")
        except PeerLost:
            logger.warning("a peer was already gone when rank 0 sent shutdown")

    # ------------------------------------------------------------ plans

    def record(self, op: Op) -> None:
        self.ops.append(op)

    def sync(self, run: Run) -> None:
        """Broadcast the ops since the last plan and the step about to run."""
        col = self.collectives
        assert col is not None
        ops, self.ops = self.ops, []
        self.seq += 1
        # Not with a Load: followers load (collectives of its own) before their digest,
        # while rank 0 would compare digests before loading.
        digest = self.seq % DIGEST_EVERY == 0 and not any(isinstance(op, Load) for op in ops)
        data = encode_plan(Plan(self.seq, ops, run, digest))
        self.watchdog.arm()
        started = time.perf_counter()
        try:
            col.broadcast(data)
        except Exception as exc:
            raise self.lost(f"broadcasting plan {self.seq} failed: {exc}") from exc
        elapsed = time.perf_counter() - started
        self.comm_seconds += elapsed
        if run:
            self.step_comm_seconds += elapsed
        self.comm_plans += 1
        self.plan_bytes += len(data)
        self.last_sync_mono = time.monotonic()
        self.last_contact = time.time()
        self.digest_pending = digest
        if not run:
            self.after_step(None)

    def after_step(self, tokens: list[int] | None) -> None:
        """The planned step ran here; ``None`` when there was no step (a heartbeat)."""
        if tokens is not None:
            self.checksum.add(tokens)
            self.checksum.step()
        if self.digest_pending:
            self.digest_pending = False
            self._exchange_digests()
        self.watchdog.disarm()

    def heartbeat(self) -> None:
        """When idle: an empty plan at most every HEARTBEAT_S (and pending ops at once)."""
        if self.collectives is None or self.state != "ready":
            return
        if self.ops or time.monotonic() - self.last_sync_mono >= HEARTBEAT_S:
            self.sync("")

    def _exchange_digests(self) -> None:
        col = self.collectives
        assert col is not None
        started = time.perf_counter()
        try:
            digests = col.gather_digests(local_digest(self.seq, self.checksum))
        except Exception as exc:
            raise self.lost(f"exchanging digests failed: {exc}") from exc
        self.comm_seconds += time.perf_counter() - started
        self.digests = digests
        self.last_contact = time.time()
        why = compare_digests(digests)
        if why is not None:
            raise self.lost(why)

    # ------------------------------------------------------------ failure

    def lost(self, message: str) -> PeerLost:
        """Mark the cluster lost (once) and return the exception to raise."""
        if self.state != "peer_lost":
            self.state = "peer_lost"
            self.error = message
            self.watchdog.stop()
            self.event("peer_lost", message)
            logger.error("cluster: %s", message)
        return PeerLost(message)

    def fatal(self, message: str, code: int = EXIT_LOST) -> None:
        """End the process through ``on_fatal`` (exit ``code``), once, from any thread."""
        with self._fatal_lock:
            if self._fatal_sent:
                return
            self._fatal_sent = True
        self.lost(message)
        self.on_fatal(self.error or message, code)

    def event(self, kind: str, message: str) -> None:
        self.events.appendleft(ClusterEvent(at=time.time(), kind=kind, message=message))

    # ------------------------------------------------------------ view

    def status(self) -> ClusterStatus:
        """The ``cluster`` section of /stats."""
        now = time.time()
        size = self.collectives.size if self.collectives else self.member.world
        age = round(now - self.last_contact, 3) if self.collectives else None
        ranks = tuple(self._rank_view(r, age) for r in range(size or 0))
        steps = max(self.checksum.steps, 1)
        return ClusterStatus(
            backend=self.member.backend,
            world_size=size,
            rank=0,
            sharding=self.sharding,
            state=self.state,
            error=self.error,
            ranks=ranks,
            plans=self.seq,
            steps=self.checksum.steps,
            plan_bytes=self.plan_bytes,
            comm_seconds=round(self.comm_seconds, 4),
            comm_ms_per_step=round(1000 * self.step_comm_seconds / steps, 3),
            join_timeout=self.settings.join_timeout,
            step_timeout=self.settings.step_timeout,
            events=tuple(self.events),
        )

    def _rank_view(self, rank: int, age: float | None) -> RankStatus:
        digest = self.digests[rank] if rank < len(self.digests) else None
        addresses = self.member.addresses
        return RankStatus(
            rank=rank,
            host=self.hosts[rank] if rank < len(self.hosts) else None,
            address=addresses[rank] if rank < len(addresses) else None,
            active_memory_bytes=digest.active_bytes if digest else 0,
            peak_memory_bytes=digest.peak_bytes if digest else 0,
            last_heartbeat_age_s=age,
        )

    # ------------------------------------------------------------ mirrored parts

    def batch_lane(
        self, loaded: LoadedModel, settings: BatchSettings, *, faults: bool = False
    ) -> MirroredBatchLane:
        return MirroredBatchLane(loaded, settings, faults=faults, leader=self)

    def serial_run(self, *args: Any, **kw: Any) -> SerialRun:
        return MirroredSerialRun(*args, leader=self, **kw)

    def prompt_cache(
        self, settings: PromptCacheSettings, batch: Callable[[], BatchSettings]
    ) -> PromptCache:
        return MirroredPromptCache(settings, leader=self, batch=batch)
