"""The one owner of scheduling: both lanes' queues, the KV budget, priority, preemption, drains.

Shaped like vLLM's scheduler (``vllm/v1/core/sched/interface.py``):
:meth:`Scheduler.add_request` queues a row, :meth:`Scheduler.schedule`
returns the :class:`~mlxd.engine.chat.step_plan.StepPlan` of one tick,
:meth:`Scheduler.update_from_output` takes what a step left,
:meth:`Scheduler.finish_requests` takes rows off the queues, and
:meth:`Scheduler.make_stats` reads it for the snapshot. The rules are the
pure policy modules (:mod:`mlxd.engine.policy`); the admission pass is
:mod:`mlxd.engine.chat.admit`. The lanes are read through
:class:`~mlxd.engine.chat.step_plan.Lanes`: no MLX here. Engine thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from mlxd.config import Settings
from mlxd.engine.chat import admit, ranking
from mlxd.engine.chat.kv_budget import KvBudget
from mlxd.engine.chat.step_plan import Join, Lanes, Preempted, SchedulerStats, Step, StepPlan
from mlxd.engine.memory import MemoryPool
from mlxd.engine.policy import admission, priority
from mlxd.engine.policy.budget import KvRoom
from mlxd.engine.policy.drain import DrainLog, LaneState, Turn, plan
from mlxd.engine.policy.stalls import StallWatch
from mlxd.engine.snapshot import PreemptionEvent

if TYPE_CHECKING:
    from mlxd.engine.chat.row import Row


class Scheduler:
    """Queues, budget, priority, preemption, drains and the stall watch of one engine.

    Args:
        settings: The live settings (replaced by :meth:`apply`).
        pool: The memory budget shared with other loaded models; None: this
            engine's ``[batch] kv_budget`` alone. ``pool_id`` names this engine in it.
        faults: Honour ``GenerationRequest.fault`` (tests only).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        pool: MemoryPool | None = None,
        pool_id: str = "",
        faults: bool = False,
    ):
        self.settings = settings
        self.faults = faults
        self.pending: deque[Row] = deque()
        self.serial_queue: deque[Row] = deque()
        # Exclusive commands (a model swap) wait for both lanes to be idle.
        self.exclusive: deque[tuple[str, Callable[[], None]]] = deque()
        self.budget = KvBudget(pool, pool_id)
        self.next_seq = 0
        # When each API key last had a request admitted (fair share's tie-break).
        self.served: dict[str, float] = {}
        self.preemptions: deque[PreemptionEvent] = deque(maxlen=32)
        self.drains = DrainLog()
        self.stalls = StallWatch()
        self.last_turn: Turn = "batch"
        self.waiting_for: str | None = None
        self.max_kv_seen = 0
        # Rows preempted in the tick being planned: id(row) -> when (they are folded after).
        self._parked: dict[int, float] = {}

    @property
    def room(self) -> KvRoom:
        """The KV budget in effect (:class:`~mlxd.engine.policy.budget.KvRoom`)."""
        return self.budget.room

    @property
    def has_work(self) -> bool:
        """Something waits: a queued row or an exclusive command."""
        return bool(self.pending or self.serial_queue or self.exclusive)

    # ------------------------------------------------------------ requests in and out

    def add_request(self, row: Row, now: float) -> None:
        """Queue ``row`` on its lane, numbered in arrival order."""
        row.seq, row.queued_mono = self.next_seq, now
        self.next_seq += 1
        (self.pending if row.lane == "batch" else self.serial_queue).append(row)

    def add_exclusive(self, reason: str, run: Callable[[], None]) -> None:
        """Queue a command that runs once both lanes are idle (a drain opens for it)."""
        self.exclusive.append((reason, run))

    def finish_requests(self, request_id: str | None = None) -> list[Row]:
        """Take the queued row ``request_id`` off its queue, or (None) every queued row."""
        taken: list[Row] = []
        for queue in (self.pending, self.serial_queue):
            for row in list(queue):
                if request_id is None or row.id == request_id:
                    queue.remove(row)
                    taken.append(row)
                    if request_id is not None:
                        return taken
        return taken

    def discard(self, row: Row) -> None:
        """Take ``row`` off its queue (the caller ends it)."""
        (self.pending if row in self.pending else self.serial_queue).remove(row)

    def queued(self) -> list[Row]:
        """Every queued row, batch queue first."""
        return [*self.pending, *self.serial_queue]

    def to_serial(self, reason: str) -> None:
        """Move every batch-queued row to the serial queue (a model that cannot batch)."""
        while self.pending:
            row = self.pending.popleft()
            row.lane, row.reason = "serial", reason
            self.serial_queue.append(row)

    # ------------------------------------------------------------ budget

    def apply(self, settings: Settings, lanes: Lanes) -> None:
        """New settings: queued rows are projected anew; those that can never fit are refused."""
        self.settings = settings
        allowance = settings.batch.decode_allowance
        for row in self.queued():
            row.extent = replace(row.extent, decode=min(row.max_tokens, allowance))
        self.update_room(lanes, recheck=True)

    def update_room(self, lanes: Lanes, *, recheck: bool = False) -> None:
        """Recompute the KV budget in effect; when it shrank (or ``recheck``: the
        projections changed), refuse the queued requests that can no longer fit."""
        if self.budget.recompute(self.settings, lanes) or recheck:
            self.refuse_unfittable(lanes)

    def refuse_unfittable(self, lanes: Lanes) -> None:
        """Refuse every queued request that cannot fit the budget even alone and uncached."""
        layout = lanes.layout()
        if layout is None:
            return
        step = self.settings.batch.prefill_step_size
        for queue in (self.pending, self.serial_queue):
            for row in list(queue):
                bare = replace(row.extent, cached=0, cuts=lanes.cuts(row, 0))
                needed = admission.alone_bytes(layout, bare, step)
                if needed > self.budget.bytes:
                    queue.remove(row)
                    self.refuse_over_budget(lanes, row, needed)

    def refuse_over_budget(self, lanes: Lanes, row: Row, needed: int) -> None:
        """End a queued ``row`` that can never fit: the documented 400, naming the key."""
        what = f"This request ({len(row.prompt)} prompt tokens + {row.extent.decode} to generate)"
        message = f"The KV budget changed while this request waited: {self.room.over(needed, what)}"
        lanes.fail(row, message, code="context_over_budget", status=400)

    def sample(self, lanes: Lanes) -> None:
        """Between steps: tell a shared pool this engine's claim, and take the room it leaves."""
        if self.budget.pool is not None:
            self.budget.report(self.budget.claim(lanes, self.settings))
            self.update_room(lanes)

    def spec_room(self, lanes: Lanes) -> int:
        """The bytes the KV budget leaves the batch now beyond what its rows hold or are
        projected to hold (draft and MTP caches included): a verify step's transients must
        fit there (:func:`~mlxd.engine.policy.spec_depth.fit_depth`)."""
        serial = lanes.serial_bytes() if lanes.serial_row() is not None else 0
        held = max(self.budget.batch_projection(lanes, self.settings), lanes.batch_bytes())
        return max(0, self.budget.admission_budget(serial) - held)

    def update_from_output(self, kv_bytes: int, *, after_step: bool) -> bool:
        """Record the KV bytes held after an admission or a step; True when a step ended
        over the budget (rows generating past their decode allowance)."""
        self.max_kv_seen = max(self.max_kv_seen, kv_bytes)
        return after_step and kv_bytes > self.budget.bytes

    # ------------------------------------------------------------ one tick

    def schedule(self, lanes: Lanes) -> StepPlan:
        """Plan one tick: order the queues, preempt, drain, and start or admit what may start.

        Refusals of rows that can never fit happen here (through ``lanes.fail``);
        everything that touches the lanes is in the plan.
        """
        now, wall = time.monotonic(), time.time()
        self._parked = {}
        serial_row, rows = lanes.serial_row(), list(lanes.batch_rows())
        self._order(rows, serial_row, now)
        preempt_serial = self._preempt_serial(lanes, serial_row, rows, now)
        if preempt_serial is not None:
            serial_row = None
        running = len(rows)
        p = plan(
            LaneState(
                batch_running=running,
                batch_pending=len(self.pending),
                serial_waiting=len(self.serial_queue),
                serial_running=serial_row is not None,
                exclusive_waiting=bool(self.exclusive),
                last_turn=self.last_turn,
                batch_outranks=self._batch_outranks(now),
            )
        )
        out = StepPlan(preempt_serial=preempt_serial)
        if p.draining and self.drains.open is None:
            if self.exclusive:
                reason, request_id = self.exclusive[0][0], None
            else:
                reason, request_id = self.serial_queue[0].reason, self.serial_queue[0].id
            self.drains.start(reason, request_id, running, wall=wall, mono=now)
            out = replace(out, drain="open", drain_reason=reason)
        if p.run_exclusive:
            _, run = self.exclusive.popleft()
            self.drains.waiter_started(mono=now)
            out = replace(out, exclusive=run)
        if p.start_serial:
            self.drains.waiter_started(mono=now)
            row = self.serial_queue.popleft()
            hit = admit.plan_cache(self, lanes, row, lanes.fetch(row))
            if hit is not None:  # else it can never fit the budget: refused
                self.served[row.key] = now
                self.last_turn = "serial"
                out = replace(out, start_serial=row, serial_hit=hit)
        if not p.admit_batch:
            self.waiting_for = p.batch_blocked_by
            step = _step(serial_row or out.start_serial, rows)
            return replace(out, step=step, waiting_for=self.waiting_for)
        if self.drains.end(wall=wall, mono=now) is not None:
            out = replace(out, drain="close")
        serial_bytes = lanes.serial_bytes() if serial_row is not None else None
        joins = admit.admit(self, lanes, rows, now, serial_bytes=serial_bytes)
        joined = rows + [j.row for j in joins]
        victim = self._preempt_batch(lanes, joined, serial_row, joins, now)
        rejoins: tuple[Join, ...] = ()
        if victim is not None:
            joined.remove(victim.row)
            rejoins = admit.admit(self, lanes, joined, now, serial_bytes=serial_bytes)
            joined += [j.row for j in rejoins]
        return replace(
            out,
            joins=joins,
            preempt_batch=victim,
            rejoins=rejoins,
            step=_step(None, joined),
            waiting_for=self.waiting_for,
        )

    # ------------------------------------------------------------ priority and preemption

    def _order(self, rows: list[Row], serial_row: Row | None, now: float) -> None:
        """Sort both queues into the order admission takes them (priority, fair share, FIFO)."""
        if len(self.pending) < 2 and len(self.serial_queue) < 2:
            return
        running = ranking.by_key(rows + ([serial_row] if serial_row is not None else []))
        r = ranking.rules(self.settings)
        for queue in (self.pending, self.serial_queue):
            ranking.sort(queue, running, now, r, self.served, self._parked)

    def _batch_outranks(self, now: float) -> bool:
        if not self.pending or not self.serial_queue:
            return False
        r = ranking.rules(self.settings)
        return ranking.outranks(self.pending[0], self.serial_queue[0], now, r, self._parked)

    def _preempting(self, lanes: Lanes) -> bool:
        return self.settings.scheduling.preempt and lanes.preemption()

    def _victim(
        self, lanes: Lanes, waiter: Row, rows: list[Row], started: dict[int, float] | None = None
    ) -> Row | None:
        layout = lanes.layout() if lanes.rewindable() else None
        return ranking.victim(waiter, rows, self.settings, layout, self.budget.bytes, started)

    def _preempt_serial(
        self, lanes: Lanes, row: Row | None, rows: list[Row], now: float
    ) -> Preempted | None:
        """The serial row yields to the head of either queue when that is more urgent.

        The serial lane runs alone, so a batch request waits for it too.
        """
        if row is None or not (self.serial_queue or self.pending) or not self._preempting(lanes):
            return None
        heads = [q[0] for q in (self.serial_queue, self.pending) if q]
        waiter = min(heads, key=lambda h: priority.rank(h.priority))
        if self._victim(lanes, waiter, [row]) is None:
            return None
        self._park(row, waiter, now)
        self.serial_queue.appendleft(row)
        self._order(rows, None, now)
        return Preempted(row, waiter, "serial")

    def _preempt_batch(
        self,
        lanes: Lanes,
        rows: list[Row],
        serial_row: Row | None,
        joins: tuple[Join, ...],
        now: float,
    ) -> Preempted | None:
        """A batch row yields to the head of the batch queue, which admission just refused."""
        if not rows or not self.pending or not self._preempting(lanes):
            return None
        waiter = self.pending[0]
        started = {id(j.row): now for j in joins}
        row = self._victim(lanes, waiter, rows, started)
        if row is None:
            return None
        self._park(row, waiter, now)
        self.pending.appendleft(row)
        self._order([r for r in rows if r is not row], serial_row, now)
        return Preempted(row, waiter, "batch")

    def _park(self, row: Row, by: Row, now: float) -> None:
        """Record that ``row`` yields to ``by`` (the step folds it and keeps its cache)."""
        self._parked[id(row)] = now
        self.preemptions.append(ranking.yielded(row, by))

    def parked(self, row: Row) -> bool:
        """Whether ``row`` yields in the tick being planned (it is not admitted again in it)."""
        return id(row) in self._parked

    # ------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state for the snapshot."""
        return SchedulerStats(
            pending=tuple(self.pending),
            serial_queue=tuple(self.serial_queue),
            waiting_for=self.waiting_for,
            budget_bytes=self.budget.bytes,
            drain_open=self.drains.open,
            drains=self.drains.events(),
            drains_total=self.drains.total,
            drain_paused_s=self.drains.total_paused_s,
            stall=next((r.stalled for r in self.pending if r.stalled), None),
            preemptions=tuple(reversed(self.preemptions)),
            max_kv_seen=self.max_kv_seen,
        )


def _step(serial: Row | None, rows: list[Row]) -> Step | None:
    if serial is not None:
        return "serial"
    return "batch" if rows else None
