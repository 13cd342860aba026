"""Rank 0 of a cluster: record what the engine does to MLX, broadcast it as plans.

The engine core runs unchanged on rank 0; its batch lane, serial lane and
prompt cache are replaced by the mirrored versions below, which record each
MLX-side operation (:mod:`mlxd.engine.cluster.plan`) and, right before the model
runs (a batch step or a serial token), broadcast the plan so the other ranks
apply the same operations and run the same step. A collective that fails, a
digest that disagrees, or a step longer than ``step_timeout`` (the watchdog)
ends the cluster: :class:`~mlxd.engine.cluster.plan.PeerLost` on the engine
thread, ``on_fatal`` from the watchdog.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from mlxd.config import BatchSettings, ClusterSettings, PromptCacheSettings
from mlxd.engine.chat.batch import BatchLane, TokenOut
from mlxd.engine.chat.prompt_cache import PromptCache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.serial import SerialRun, SerialStep
from mlxd.engine.cluster.join import Membership
from mlxd.engine.cluster.plan import (
    Collectives,
    Configure,
    EndSerial,
    Fetch,
    Insert,
    Load,
    Op,
    PeerLost,
    Plan,
    Remove,
    ResetBatch,
    RowSpec,
    Run,
    Seed,
    Shutdown,
    StartSerial,
    Store,
    TokenChecksum,
    Trim,
    compare_digests,
    encode_plan,
    is_collective_error,
    local_digest,
    tokens_crc,
)

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.1
DIGEST_EVERY = 8


def row_spec(row: Row) -> RowSpec:
    r = row.request
    s, p = r.sampling, r.penalties
    return RowSpec(
        id=r.id,
        lane=row.lane,
        prompt=list(row.prompt),
        max_tokens=row.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=[(int(k), float(v)) for k, v in p.logit_bias],
        logprobs=r.logprobs,
        top_logprobs=r.top_logprobs,
        fault=r.fault,
        constraint=(c.kind, c.grammar, c.key, c.tool_format) if (c := r.constraint) else None,
        reasoning=row.matcher is not None and not getattr(row.matcher, "active", True),
    )


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
        self.state = "forming"
        self.error: str | None = None
        self.hosts: list[str] = []
        self.rank_memory: list[tuple[int, int]] = []
        self.last_contact = time.time()
        self.last_sync_mono = 0.0
        self.busy_since: float | None = None
        self.digest_pending = False
        self.comm_seconds = 0.0
        # The part of comm_seconds spent on plans that ran a step.
        self.step_comm_seconds = 0.0
        self.comm_plans = 0
        self.plan_bytes = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=16)
        # Set by whoever runs the process (the server): ends it, non-zero.
        self.on_fatal: Callable[[str, int], None] = lambda message, code: None
        self._fatal_lock = threading.Lock()
        self._fatal_sent = False

    # ------------------------------------------------------------ start

    def join(self, group: Any, batch: BatchSettings, cache: PromptCacheSettings) -> None:
        """After ``init``: learn every rank's host, seed MLX and send the live settings."""
        import mlx.core as mx

        self.collectives = Collectives(group)
        self.hosts = self.collectives.gather_text(socket.gethostname())
        self.rank_memory = [(0, 0)] * self.collectives.size
        seed = secrets.randbits(31)
        mx.random.seed(seed)
        self.record(Seed(seed))
        self.configure(batch, cache)
        self.state = "ready"
        self.last_contact = time.time()
        self.event("joined", f"{self.collectives.size} ranks: {', '.join(self.hosts)}")

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
        self.busy_since = time.monotonic()
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
            self._exchange_digest()
        self.busy_since = None

    def heartbeat(self) -> None:
        """When idle: an empty plan at most every HEARTBEAT_S (and pending ops at once)."""
        if self.collectives is None or self.state != "ready":
            return
        if self.ops or time.monotonic() - self.last_sync_mono >= HEARTBEAT_S:
            self.sync("")

    def _exchange_digest(self) -> None:
        col = self.collectives
        assert col is not None
        started = time.perf_counter()
        try:
            rows = col.gather(local_digest(self.seq, self.checksum).values())
        except Exception as exc:
            raise self.lost(f"exchanging digests failed: {exc}") from exc
        self.comm_seconds += time.perf_counter() - started
        self.rank_memory = [(r[3], r[4]) for r in rows]
        self.last_contact = time.time()
        why = compare_digests(rows)
        if why is not None:
            raise self.lost(why)

    # ------------------------------------------------------------ failure

    def lost(self, message: str) -> PeerLost:
        """Mark the cluster lost (once) and return the exception to raise."""
        if self.state != "peer_lost":
            self.state = "peer_lost"
            self.error = message
            self.event("peer_lost", message)
            logger.error("cluster: %s", message)
        return PeerLost(message)

    def fatal(self, message: str, code: int = 3) -> None:
        """End the process through ``on_fatal`` (exit ``code``), once, from any thread."""
        with self._fatal_lock:
            if self._fatal_sent:
                return
            self._fatal_sent = True
        self.lost(message)
        self.on_fatal(self.error or message, code)

    def watch(self) -> None:
        """Start the watchdog thread: a step longer than ``step_timeout`` ends the cluster."""
        timeout = self.settings.step_timeout

        def loop() -> None:
            while self.state != "peer_lost":
                since = self.busy_since
                if since is not None and time.monotonic() - since > timeout:
                    self.fatal(
                        f"a step has waited on the other ranks for more than step_timeout "
                        f"({timeout:g}s): a peer is unreachable or stuck"
                    )
                    return
                time.sleep(min(1.0, timeout / 10))

        threading.Thread(target=loop, name="mlxd-cluster-watchdog", daemon=True).start()

    def event(self, kind: str, message: str) -> None:
        self.events.appendleft({"at": time.time(), "kind": kind, "message": message})

    # ------------------------------------------------------------ view

    def view(self) -> dict[str, Any]:
        """The ``cluster`` section of /stats."""
        now = time.time()
        size = self.collectives.size if self.collectives else self.member.world
        ranks = []
        for r in range(size or 0):
            active, peak = self.rank_memory[r] if r < len(self.rank_memory) else (0, 0)
            ranks.append(
                {
                    "rank": r,
                    "host": self.hosts[r] if r < len(self.hosts) else None,
                    "address": self.member.addresses[r] if r < len(self.member.addresses) else None,
                    "active_memory_bytes": active,
                    "peak_memory_bytes": peak,
                    "last_heartbeat_age_s": round(now - self.last_contact, 3)
                    if self.collectives
                    else None,
                }
            )
        steps = max(self.checksum.steps, 1)
        return {
            "backend": self.member.backend,
            "world_size": size,
            "rank": 0,
            "sharding": self.sharding,
            "state": self.state,
            "error": self.error,
            "ranks": ranks,
            "plans": self.seq,
            "steps": self.checksum.steps,
            "plan_bytes": self.plan_bytes,
            "comm_seconds": round(self.comm_seconds, 4),
            "comm_ms_per_step": round(1000 * self.step_comm_seconds / steps, 3),
            "join_timeout": self.settings.join_timeout,
            "step_timeout": self.settings.step_timeout,
            "events": list(self.events),
        }

    # ------------------------------------------------------------ mirrored parts

    def batch_lane(self, loaded: Any, settings: BatchSettings, *, faults: bool = False):
        return MirroredBatchLane(loaded, settings, faults=faults, leader=self)

    def serial_run(self, *args: Any, **kw: Any) -> SerialRun:
        return MirroredSerialRun(*args, leader=self, **kw)

    def prompt_cache(
        self, settings: PromptCacheSettings, batch: Callable[[], BatchSettings]
    ) -> PromptCache:
        return MirroredPromptCache(settings, leader=self, batch=batch)


class MirroredBatchLane(BatchLane):
    """The batch lane on rank 0: every change is recorded, every step is planned."""

    def __init__(self, loaded: Any, settings: BatchSettings, *, faults: bool, leader: Leader):
        super().__init__(loaded, settings, faults=faults)
        self._leader = leader

    def insert(self, row: Row, cache: list[Any] | None, rest: list[int]) -> None:
        super().insert(row, cache, rest)
        self._leader.record(Insert(int(row.uid or 0), row_spec(row)))

    def remove(self, rows: list[Row], *, return_caches: bool = False) -> dict[int, Any]:
        uids = [int(r.uid) for r in rows if r.uid in self.rows]
        if uids:
            self._leader.record(Remove(uids, return_caches))
        return super().remove(rows, return_caches=return_caches)

    def reset(self, settings: BatchSettings) -> list[Row]:
        self._leader.record(ResetBatch())
        return super().reset(settings)

    def step(self) -> list[TokenOut]:
        leader = self._leader
        leader.sync("batch")
        try:
            outs = super().step()
        except Exception as exc:
            if is_collective_error(exc):
                raise leader.lost(f"the batched step lost a peer: {exc}") from exc
            leader.after_step([])
            raise
        leader.after_step([o.token for o in outs])
        return outs


class MirroredSerialRun(SerialRun):
    """The serial lane on rank 0: started, stepped and ended in step with every rank."""

    def __init__(self, *args: Any, leader: Leader, **kw: Any):
        self._leader = leader
        self._ended = False
        row = args[1]
        leader.record(StartSerial(row_spec(row)))
        super().__init__(*args, **kw)

    def _progress(self, done: int, total: int) -> None:
        # A cancel cannot stop a prefill midway: every rank must run the same chunks.
        self.row.prefill_done = done
        if done < total:
            self._pump()

    def step(self, eos_ids: Collection[int]) -> SerialStep:
        leader = self._leader
        runs = not self.row.cancelled
        before = self.row.generated
        if runs:
            leader.sync("serial")
        out = super().step(eos_ids)
        if runs:
            if out.engine_error and out.error and is_collective_error(out.error):
                raise leader.lost(f"the serial step lost a peer: {out.error}")
            new = self.row.generated_ids[before:] if self.row.generated > before else []
            leader.after_step(list(new))
        return out

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self._leader.record(EndSerial())
        super().close()


class MirroredPromptCache(PromptCache):
    """The prompt cache on rank 0: lookups, stores and evictions are recorded."""

    def __init__(
        self,
        settings: PromptCacheSettings,
        *,
        leader: Leader,
        batch: Callable[[], BatchSettings],
    ):
        super().__init__(settings)
        self._leader = leader
        self._batch = batch

    def configure(self, settings: PromptCacheSettings, live_bytes: int) -> None:
        self._leader.configure(self._batch(), settings)
        super().configure(settings, live_bytes)
        self._trimmed()

    def fetch(self, model_key: str, prompt: list[int]) -> tuple[list[Any] | None, list[int]]:
        cache, rest = super().fetch(model_key, prompt)
        self._leader.record(Fetch(list(prompt), len(prompt) - len(rest)))
        return cache, rest

    def store(
        self, model_key: str, tokens: list[int] | None, cache: list[Any] | None, live_bytes: int
    ) -> None:
        if cache is None or not tokens or not self.enabled:
            return
        self._leader.record(Store(len(tokens), tokens_crc(list(tokens))))
        super().store(model_key, tokens, cache, live_bytes)
        self._trimmed()

    def trim(self, live_bytes: int) -> None:
        before = len(self._lru)
        super().trim(live_bytes)
        if len(self._lru) != before:
            self._trimmed()

    def clear(self) -> None:
        super().clear()
        self._leader.record(Trim(0))

    def _trimmed(self) -> None:
        self._leader.record(Trim(len(self._lru)))
