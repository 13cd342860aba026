"""The scheduler's admission pass: which queued rows join the batch, with which cache hit.

Part of :class:`~mlxd.engine.chat.scheduler.Scheduler` (docs/batching.md,
"Admission never wedges"). The batch queue is taken in its order while the
pure rule (:func:`mlxd.engine.policy.admission.check_admission`) and the
shared memory pool allow it: the first row that does not fit stops the
pass, unless it is stalled (refused on an idle lane, see
:mod:`mlxd.engine.policy.stalls`): then the rows behind it may still join,
in their order. A row's prompt-cache hit is cut back to a step boundary or
dropped when it would keep the row from ever fitting the budget; a row
that cannot fit even bare gets its 400. No MLX: the lanes are read
through :class:`~mlxd.engine.chat.step_plan.Lanes`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from mlxd.config import Settings, format_bytes
from mlxd.engine.chat.kv_budget import KvBudget
from mlxd.engine.chat.step_plan import Join, Lanes
from mlxd.engine.policy import admission
from mlxd.engine.policy.admission import Admission
from mlxd.engine.policy.drain import Turn
from mlxd.engine.policy.stalls import StallWatch

if TYPE_CHECKING:
    from mlxd.engine.chat.row import Hit, Row

logger = logging.getLogger(__name__)


class Scheduler(Protocol):
    """What the admission pass reads and changes of the scheduler (``scheduler.Scheduler``)."""

    settings: Settings
    faults: bool
    pending: deque[Row]
    budget: KvBudget
    served: dict[str, float]
    stalls: StallWatch
    waiting_for: str | None
    last_turn: Turn

    def parked(self, row: Row) -> bool: ...
    def refuse_over_budget(self, lanes: Lanes, row: Row, needed: int) -> None: ...


def admit(
    sched: Scheduler, lanes: Lanes, rows: list[Row], now: float, *, serial_bytes: int | None
) -> tuple[Join, ...]:
    """The queued rows that join the batch now, next to the running ``rows``; says why
    the rest wait (``sched.waiting_for``) and reports the pass to the stall watch.

    ``serial_bytes``: the serial row's real bytes, None when the serial lane is idle
    (or its row yields this tick)."""
    sched.waiting_for = None
    if not sched.pending:
        return ()
    pending = sched.pending
    running = list(rows)
    joins: list[Join] = []
    blocking: tuple[Row, Admission] | None = None  # the row that stopped admission
    raced = False
    index = 0
    while index < len(pending):
        row = pending[index]
        if sched.parked(row):  # it yields this tick: it waits at least until the next one
            sched.waiting_for = (
                sched.waiting_for or _check(sched, lanes, running, row, serial_bytes).waiting_for
            )
            break
        if row.prefetched is None:
            row.prefetched = lanes.fetch(row)
        # Planned on every pass: the budget may have shrunk since the lookup.
        hit = plan_cache(sched, lanes, row, row.prefetched)
        if hit is None:  # it can never fit the budget: refused
            del pending[index]
            continue
        row.prefetched = hit
        check = _check(sched, lanes, running, row, serial_bytes)
        if check.admit and not _claim(sched, lanes, check, serial_bytes or 0):
            sched.waiting_for, raced = "budget", True  # another model claimed it meanwhile
            break
        if not check.admit:
            sched.waiting_for = sched.waiting_for or check.waiting_for
            if row.stalled is None:
                blocking = (row, check)
                break
            index += 1
            continue
        del pending[index]
        row.prefetched = None
        sched.served[row.key] = now
        sched.last_turn = "batch"
        joins.append(Join(row, hit))
        running.append(row)
    idle = not running and serial_bytes is None
    _watch(sched, None if raced else blocking, idle=idle, serial_bytes=serial_bytes or 0)
    return tuple(joins)


def plan_cache(sched: Scheduler, lanes: Lanes, row: Row, hit: Hit) -> Hit | None:
    """``row``'s lookup, its hit cut back or dropped when it would keep the row from ever
    fitting the budget; None when not even the bare request fits: the row is refused
    (a 400), and the caller takes it off its queue.

    Also sets ``row.extent`` to what admission projects: the prefix kept, and the
    positions where the prefill stops for checkpoints.
    """
    layout = lanes.layout()
    assert layout is not None
    cached = len(row.prompt) - len(hit.rest)
    extent = _extent(lanes, row, cached)
    plan = admission.plan_hit(
        layout,
        extent,
        sched.budget.bytes,
        sched.settings.batch.prefill_step_size,
        trimmable=hit.cache is not None and lanes.trimmable(hit),
        cuts=lambda n: lanes.cuts(row, n),
    )
    if plan.refused is not None:
        sched.refuse_over_budget(lanes, row, plan.refused)
        return None
    if plan.cached < cached:
        hit = lanes.cut(row, hit, plan.cached)
        extent = _extent(lanes, row, plan.cached)
    row.extent = extent
    return hit


def _extent(lanes: Lanes, row: Row, cached: int) -> admission.RowExtent:
    return replace(row.extent, cached=cached, cuts=lanes.cuts(row, cached))


def _check(
    sched: Scheduler, lanes: Lanes, running: list[Row], row: Row, serial_bytes: int | None
) -> Admission:
    layout = lanes.layout()
    assert layout is not None
    s = sched.settings.batch
    check = admission.check_admission(
        layout,
        [r.projected() for r in running],
        row.projected(),
        batch_size=s.size,
        budget=sched.budget.admission_budget(serial_bytes or 0),
        real_bytes=lanes.batch_bytes(),
        prefill_step_size=s.prefill_step_size,
        prompt_concurrency=s.prompt_concurrency,
    )
    if sched.faults and row.request.fault == "never_admit":
        return Admission(False, "budget", check.projected_bytes)  # a stand-in for a wedge bug
    return check


def _claim(sched: Scheduler, lanes: Lanes, check: Admission, serial_bytes: int) -> bool:
    """Raise this model's claim on a shared memory pool to cover the admitted batch."""
    return sched.budget.claim_kv(max(check.projected_bytes, lanes.batch_bytes()) + serial_bytes)


def _watch(
    sched: Scheduler, blocking: tuple[Row, Admission] | None, *, idle: bool, serial_bytes: int
) -> None:
    """Tell the stall watch whether a row was refused on an idle lane with its budget free."""
    free = sched.budget.admission_budget(serial_bytes) >= sched.budget.bytes
    stuck = blocking if blocking is not None and idle and free else None
    if not sched.stalls.observe(stuck[0].id if stuck else None, time.monotonic()) or not stuck:
        return
    row, check = stuck
    row.stalled = (
        f"request {row.id} waits for {check.waiting_for} while the batch is idle (it projects "
        f"{format_bytes(check.projected_bytes)} of KV cache, the budget is "
        f"{format_bytes(sched.budget.bytes)}); the requests behind it are admitted past it"
    )
    logger.error("admission stalled: %s; this is a bug, please report it", row.stalled)
