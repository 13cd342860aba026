"""The values between the scheduler and the step: the plan of one tick, and what the lanes tell.

:class:`StepPlan` is what :meth:`Scheduler.schedule
<mlxd.engine.chat.scheduler.Scheduler.schedule>` decides for one tick; the
step (:mod:`mlxd.engine.chat.step`) carries it out in field order and decides
nothing itself. :class:`Lanes` is the MLX side the scheduler reads through
(rows running, real bytes, prompt-cache lookups), so that the scheduler
imports no MLX and is unit-tested with fake rows and lanes. No logic here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from mlxd.engine.messages import ErrorCode
from mlxd.engine.policy.admission import CacheLayout
from mlxd.engine.snapshot import PreemptionEvent

if TYPE_CHECKING:
    from mlxd.engine.chat.row import Hit, Row
    from mlxd.engine.policy.drain import DrainEvent

Step = Literal["serial", "batch"]


@dataclass(frozen=True)
class Join:
    """A row that leaves the batch queue for the batch, from ``hit`` (its planned cache hit).

    Room for what comes next (not implemented; the step ignores them while empty):

    - ``draft_tokens``: the row's draft tokens for speculative decoding;
    - ``kv_bytes_per_token``: its KV bytes per token when its cache is quantized
      (0: the layout's own);
    - ``position_offsets``: its per-row position offsets (mrope), empty for plain text.
    """

    row: Row
    hit: Any
    draft_tokens: tuple[int, ...] = ()
    kv_bytes_per_token: int = 0
    position_offsets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Preempted:
    """A running row that yields to ``by``; it is back at the head of its class's queue."""

    row: Row
    by: Row
    lane: Step


@dataclass(frozen=True)
class StepPlan:
    """What one tick does, in the order the step carries it out.

    ``preempt_serial`` yields first (the serial run closes, its cache is kept);
    then ``exclusive`` runs (both lanes idle), or ``start_serial`` starts from
    ``serial_hit``, or ``joins`` enter the batch; then ``preempt_batch`` leaves
    the batch and ``rejoins`` enter it. ``step`` says which lane steps after.
    """

    exclusive: Callable[[], None] | None = None
    # "open" or "close" when a drain starts or ends this tick, and why it opened.
    drain: Literal["open", "close"] | None = None
    drain_reason: str | None = None
    preempt_serial: Preempted | None = None
    start_serial: Row | None = None
    serial_hit: Any = None
    joins: tuple[Join, ...] = ()
    preempt_batch: Preempted | None = None
    rejoins: tuple[Join, ...] = ()
    step: Step | None = None
    # Why the batch queue's head waits ("budget", "batch_full", "drain", "serial_lane").
    waiting_for: str | None = None


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state for the snapshot (:mod:`mlxd.engine.chat.snapshots`)."""

    pending: tuple[Row, ...]
    serial_queue: tuple[Row, ...]
    waiting_for: str | None
    budget_bytes: int
    drain_open: DrainEvent | None
    drains: tuple[DrainEvent, ...]
    drains_total: int
    drain_paused_s: float
    stall: str | None
    preemptions: tuple[PreemptionEvent, ...]
    max_kv_seen: int


class Lanes(Protocol):
    """What the scheduler reads from the lanes and the prompt cache (engine thread)."""

    def layout(self) -> CacheLayout | None:
        """The served model's cache layout; None while no model is loaded."""
        ...

    def batch_rows(self) -> Sequence[Row]: ...
    def batch_lone(self) -> bool: ...
    def batch_bytes(self) -> int: ...
    def serial_row(self) -> Row | None: ...
    def serial_bytes(self) -> int: ...

    def rewindable(self) -> bool:
        """Whether the served model's caches can be cut back (preemption needs it)."""
        ...

    def preemption(self) -> bool:
        """Whether the engine's hooks allow preemption (a cluster does not)."""
        ...

    def auto_budget(self) -> int:
        """What ``kv_budget = "auto"`` leaves of the device for KV."""
        ...

    def fetch(self, row: Row) -> Hit:
        """The nearest cached prefix of ``row``'s prompt (RAM or disk)."""
        ...

    def trimmable(self, hit: Hit) -> bool: ...

    def cut(self, row: Row, hit: Hit, cached: int) -> Hit:
        """``hit`` cut back to its first ``cached`` tokens (0: none)."""
        ...

    def cuts(self, row: Row, cached: int) -> tuple[int, ...]:
        """Where ``row``'s prefill stops for checkpoints, starting from ``cached`` tokens."""
        ...

    def fail(self, row: Row, message: str, *, code: ErrorCode, status: int) -> None:
        """End a queued ``row`` with an error."""
        ...
