"""The scheduler (mlxd.engine.chat.scheduler) with fake rows and fake lanes: no model, no daemon.

The lanes are a :class:`FakeLanes` (rows running, real bytes, cache hits);
each test plans ticks with ``schedule()`` and carries the plan out on the
fakes the way :mod:`mlxd.engine.chat.step` does on the real lanes. The KV
layout costs one byte per token slot, so budgets read as token slots.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

from mlxd.config import Settings
from mlxd.engine.chat.scheduler import Scheduler
from mlxd.engine.chat.step_plan import Join, StepPlan
from mlxd.engine.policy import admission, stalls
from mlxd.engine.policy.admission import CacheLayout, LayerLayout, RowExtent

LAYOUT = CacheLayout((LayerLayout("full", bytes_per_token=1),))
STEP = 512


@dataclass(eq=False)
class FakeRow:
    """The fields of :class:`~mlxd.engine.chat.row.Row` the scheduler reads."""

    id: str
    prompt: list[int]
    max_tokens: int = 10
    priority: str = "normal"
    key: str = ""
    lane: str = "batch"
    reason: str = "batchable"
    seed: int | None = None
    fault: str | None = None
    extent: RowExtent = field(default_factory=lambda: RowExtent(0))
    seq: int = 0
    queued_mono: float = 0.0
    resumed: bool = False
    folded: int = 0
    generated: int = 0
    generated_ids: list[int] = field(default_factory=list)
    first_token_mono: float | None = None
    started_mono: float = 0.0
    prefill_done: int = 0
    prefetched: Any = None
    stalled: str | None = None
    cancelled: bool = False
    error: BaseException | None = None
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.extent = admission.row_extent(len(self.prompt), self.max_tokens, 2048)
        sampling = SimpleNamespace(seed=self.seed)
        self.request = SimpleNamespace(sampling=sampling, fault=self.fault, client=self.key or None)

    @property
    def tokens_left(self) -> int:
        return max(0, self.max_tokens - self.generated)

    def projected(self) -> RowExtent:
        return replace(
            self.extent, prefilling=self.first_token_mono is None, prefilled=self.prefill_done
        )

    def decode(self, n: int) -> None:
        """The row generates ``n`` tokens."""
        self.first_token_mono = self.first_token_mono or time.monotonic()
        self.generated += n
        self.generated_ids += [7] * n

    def fold(self) -> None:
        self.prompt = self.prompt + self.generated_ids[self.folded :]
        self.folded, self.resumed = self.generated, True
        self.queued_mono, self.prefetched = time.monotonic(), None


@dataclass(frozen=True)
class FakeHit:
    cache: Any
    rest: list[int]


class FakeLanes:
    """The lanes and prompt cache as the scheduler reads them; ``cached`` hits by row id."""

    def __init__(self, *, preemption: bool = True):
        self.rows: list[FakeRow] = []
        self.serial: FakeRow | None = None
        self.real_bytes = 0
        self.cached: dict[str, int] = {}
        self.failed: list[tuple[str, str, int, str]] = []
        self._preemption = preemption

    def layout(self) -> CacheLayout:
        return LAYOUT

    def batch_rows(self) -> list[FakeRow]:
        return self.rows

    def batch_lone(self) -> bool:
        return len(self.rows) == 1

    def batch_bytes(self) -> int:
        return self.real_bytes

    def serial_row(self) -> FakeRow | None:
        return self.serial

    def serial_bytes(self) -> int:
        return 0

    def rewindable(self) -> bool:
        return True

    def preemption(self) -> bool:
        return self._preemption

    def auto_budget(self) -> int:
        return 10**9

    def fetch(self, row: FakeRow) -> FakeHit:
        n = self.cached.get(row.id, 0)
        return FakeHit(object() if n else None, row.prompt[n:])

    def trimmable(self, hit: FakeHit) -> bool:
        return True

    def cut(self, row: FakeRow, hit: FakeHit, cached: int) -> FakeHit:
        return FakeHit(hit.cache if cached else None, row.prompt[cached:])

    def cuts(self, row: FakeRow, cached: int) -> tuple[int, ...]:
        return ()

    def fail(self, row: FakeRow, message: str, *, code: str, status: int) -> None:
        self.failed.append((row.id, code, status, message))

    def execute(self, plan: StepPlan) -> None:
        """Carry ``plan`` out as :func:`mlxd.engine.chat.step.execute` does."""
        if plan.preempt_serial is not None:
            self.serial = None
            cast(FakeRow, plan.preempt_serial.row).fold()
        if plan.start_serial is not None:
            self.serial = cast(FakeRow, plan.start_serial)
        self._join(plan.joins)
        if plan.preempt_batch is not None:
            row = cast(FakeRow, plan.preempt_batch.row)
            self.rows.remove(row)
            row.fold()
        self._join(plan.rejoins)

    def _join(self, joins: tuple[Join, ...]) -> None:
        for join in joins:
            row = cast(FakeRow, join.row)
            row.resumed, row.started_mono = False, time.monotonic()
            self.rows.append(row)


def settings(
    *, kv_budget: int = 100_000, size: int = 8, preempt: bool = False, aging: float = 0.0
) -> Settings:
    s = Settings()
    return s.model_copy(
        update={
            "batch": s.batch.model_copy(update={"kv_budget": kv_budget, "size": size}),
            "scheduling": s.scheduling.model_copy(
                update={"preempt": preempt, "aging": aging, "fair_share": True}
            ),
        }
    )


def make(lanes: FakeLanes, **kw: Any) -> Scheduler:
    sched = Scheduler(settings(**kw), faults=True)
    sched.update_room(cast(Any, lanes))
    return sched


def add(sched: Scheduler, row: FakeRow, at: float | None = None) -> FakeRow:
    sched.add_request(cast(Any, row), time.monotonic() if at is None else at)
    return row


def tick(sched: Scheduler, lanes: FakeLanes) -> StepPlan:
    plan = sched.schedule(cast(Any, lanes))
    lanes.execute(plan)
    return plan


def ids(rows: Any) -> list[str]:
    return [r.id for r in rows]


# ------------------------------------------------------------ priority order


def test_a_more_urgent_class_is_admitted_before_earlier_arrivals():
    lanes = FakeLanes()
    sched = make(lanes, size=1)
    add(sched, FakeRow("normal", [1] * 10))
    add(sched, FakeRow("urgent", [1] * 10, priority="high"))
    plan = tick(sched, lanes)
    assert ids(j.row for j in plan.joins) == ["urgent"]
    assert ids(sched.pending) == ["normal"] and plan.waiting_for == "batch_full"
    assert plan.step == "batch"


def test_keys_take_turns_within_a_class_and_keep_their_own_order():
    lanes = FakeLanes()
    sched = make(lanes, size=1)
    for name in ("a1", "a2", "a3"):
        add(sched, FakeRow(name, [1] * 10, key="a"))
    add(sched, FakeRow("b1", [1] * 10, key="b"))
    add(sched, FakeRow("c1", [1] * 10, key="c"))
    plan = tick(sched, lanes)
    assert ids(j.row for j in plan.joins) == ["a1"]
    # a1 runs: b and c have a turn before a's next one; a's rows stay in arrival order.
    assert ids(sched.pending) == ["b1", "c1", "a2", "a3"]


def test_aging_lifts_a_long_waiting_request_above_a_newer_more_urgent_one():
    lanes = FakeLanes()
    sched = make(lanes, size=1, aging=60.0)
    now = time.monotonic()
    add(sched, FakeRow("old-low", [1] * 10, priority="low"), at=now - 130)
    add(sched, FakeRow("new-normal", [1] * 10), at=now)
    plan = tick(sched, lanes)
    assert ids(j.row for j in plan.joins) == ["old-low"]
    sched2 = make(FakeLanes(), size=1, aging=0.0)
    add(sched2, FakeRow("old-low", [1] * 10, priority="low"), at=now - 130)
    add(sched2, FakeRow("new-normal", [1] * 10), at=now)
    assert ids(j.row for j in tick(sched2, FakeLanes()).joins) == ["new-normal"]


# ------------------------------------------------------------ preemption


def running(lanes: FakeLanes, sched: Scheduler, row: FakeRow, tokens: int = 3) -> FakeRow:
    add(sched, row)
    tick(sched, lanes)
    assert row in lanes.rows
    if tokens:
        row.decode(tokens)
    return row


def test_a_bulk_row_yields_to_an_interactive_one_and_resumes_first_in_its_class():
    lanes = FakeLanes()
    sched = make(lanes, size=1, preempt=True)
    bulk = running(lanes, sched, FakeRow("bulk", [1] * 10, priority="batch"))
    later = add(sched, FakeRow("later-bulk", [1] * 10, priority="batch"))
    urgent = add(sched, FakeRow("urgent", [1] * 10, priority="high"))
    plan = tick(sched, lanes)
    assert plan.preempt_batch is not None and plan.preempt_batch.row is bulk
    assert plan.preempt_batch.by is urgent and plan.preempt_batch.lane == "batch"
    assert ids(j.row for j in plan.rejoins) == ["urgent"] and lanes.rows == [urgent]
    # The yielded row waits ahead of a later request of its class, its tokens folded in.
    assert list(sched.pending) == [bulk, later] and bulk.resumed and len(bulk.prompt) == 13
    event = sched.make_stats().preemptions[0]
    assert (event.request_id, event.by_request_id, event.generated_tokens) == ("bulk", "urgent", 3)


@pytest.mark.parametrize("kind", ["seeded", "prefilling", "same class", "disabled"])
def test_rows_that_may_not_yield_keep_running(kind: str):
    lanes = FakeLanes()
    sched = make(lanes, size=1, preempt=kind != "disabled")
    row = FakeRow("bulk", [1] * 10, priority="batch", seed=7 if kind == "seeded" else None)
    running(lanes, sched, row, tokens=0 if kind == "prefilling" else 3)
    waiter = "batch" if kind == "same class" else "high"
    add(sched, FakeRow("urgent", [1] * 10, priority=waiter))
    plan = tick(sched, lanes)
    assert plan.preempt_batch is None and not plan.rejoins and not plan.joins
    assert lanes.rows == [row] and ids(sched.pending) == ["urgent"]
    assert plan.waiting_for == "batch_full" and not sched.make_stats().preemptions


def test_a_serial_row_yields_to_a_more_urgent_batch_request():
    lanes = FakeLanes()
    sched = make(lanes, preempt=True)
    lone = add(sched, FakeRow("seeded", [1] * 10, lane="serial", reason="seed", priority="low"))
    tick(sched, lanes)
    assert lanes.serial is lone
    lone.decode(2)
    urgent = add(sched, FakeRow("urgent", [1] * 10, priority="high"))
    plan = tick(sched, lanes)
    assert plan.preempt_serial is not None and plan.preempt_serial.row is lone
    assert ids(j.row for j in plan.joins) == ["urgent"] and lanes.serial is None
    assert list(sched.serial_queue) == [lone] and plan.step == "batch"
    assert lanes.rows == [urgent]


# ------------------------------------------------------------ admission never wedges


def test_a_stalled_head_lets_the_rows_behind_it_join(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(stalls, "STALL_SECONDS", 0.0)
    lanes = FakeLanes()
    sched = make(lanes)
    head = add(sched, FakeRow("wedged", [1] * 10, fault="never_admit"))
    behind = add(sched, FakeRow("behind", [1] * 10))
    for _ in range(stalls.STALL_PASSES - 1):
        plan = tick(sched, lanes)
        assert not plan.joins and plan.waiting_for == "budget" and head.stalled is None
    plan = tick(sched, lanes)  # the fifth refusal on an idle lane: stalled
    assert head.stalled is not None and "request wedged waits for budget" in head.stalled
    assert sched.make_stats().stall == head.stalled
    plan = tick(sched, lanes)
    assert ids(j.row for j in plan.joins) == ["behind"] and lanes.rows == [behind]
    assert list(sched.pending) == [head]


def test_a_request_that_can_never_fit_is_refused_with_its_400():
    lanes = FakeLanes()
    sched = make(lanes, kv_budget=1000)
    add(sched, FakeRow("huge", [1] * 5000))
    small = add(sched, FakeRow("small", [1] * 10))
    plan = tick(sched, lanes)
    assert ids(j.row for j in plan.joins) == ["small"] and lanes.rows == [small]
    ((rid, code, status, message),) = lanes.failed
    assert (rid, code, status) == ("huge", "context_over_budget", 400)
    assert message.startswith(
        "The KV budget changed while this request waited: This request (5000 prompt tokens "
        "+ 10 to generate) needs about "
    )
    assert "[batch] kv_budget" in message and not sched.pending


def test_a_cache_hit_that_would_never_fit_is_cut_back_and_the_row_runs():
    lanes = FakeLanes()
    # 300 prompt tokens fit alone from nothing (capacity 512); a 300-token hit does not.
    alone = admission.alone_bytes(LAYOUT, RowExtent(301, 10), STEP)
    sched = make(lanes, kv_budget=alone)
    row = FakeRow("hit", [1] * 301)
    lanes.cached["hit"] = 300
    add(sched, row)
    plan = tick(sched, lanes)
    assert ids(j.row for j in plan.joins) == ["hit"] and not lanes.failed
    assert row.extent.cached in (0, 256) and len(plan.joins[0].hit.rest) == 301 - row.extent.cached


# ------------------------------------------------------------ the KV promise


def test_admitted_projections_never_exceed_the_budget():
    lanes = FakeLanes()
    budget = 3000
    sched = make(lanes, kv_budget=budget, size=16)
    for i, n in enumerate([700, 50, 400, 900, 120, 30, 800, 260, 10, 600]):
        add(sched, FakeRow(f"r{i}", [1] * n, max_tokens=40))
    admitted: list[str] = []
    for _ in range(30):
        plan = tick(sched, lanes)
        admitted += ids(j.row for j in plan.joins)
        projected = admission.project_batch_bytes(
            LAYOUT,
            [r.projected() for r in lanes.rows],
            STEP,
            lone=len(lanes.rows) == 1,
            prompt_concurrency=sched.settings.batch.prompt_concurrency,
        )
        assert projected <= budget, (ids(lanes.rows), projected)
        if lanes.rows:  # the oldest row ends: room for the next ones
            lanes.rows.pop(0)
    assert sorted(admitted) == sorted(f"r{i}" for i in range(10)) and not lanes.failed
    assert len(set(admitted)) == 10


def test_a_shrunken_budget_refuses_queued_rows_that_can_no_longer_fit():
    lanes = FakeLanes()
    sched = make(lanes, size=1)
    running(lanes, sched, FakeRow("running", [1] * 10))
    big = add(sched, FakeRow("big", [1] * 2000))
    small = add(sched, FakeRow("small", [1] * 10))
    sched.apply(settings(kv_budget=1000, size=1), cast(Any, lanes))
    assert ids(sched.pending) == ["small"] and sched.room.bytes == 1000
    ((rid, code, status, message),) = lanes.failed
    assert (rid, code, status) == ("big", "context_over_budget", 400) and big.id == rid
    assert "raise [batch] kv_budget" in message
    assert small in sched.pending


# ------------------------------------------------------------ drains


def test_a_serial_request_drains_the_batch_and_admission_resumes_after():
    lanes = FakeLanes()
    sched = make(lanes)
    first = running(lanes, sched, FakeRow("first", [1] * 10))
    serial = add(sched, FakeRow("seeded", [1] * 10, lane="serial", reason="seed"))
    late = add(sched, FakeRow("late", [1] * 10))
    plan = tick(sched, lanes)
    assert list(sched.pending) == [late]
    assert (plan.drain, plan.drain_reason, plan.waiting_for) == ("open", "seed", "drain")
    assert not plan.joins and plan.start_serial is None and plan.step == "batch"
    assert sched.make_stats().drain_open is not None
    lanes.rows.remove(first)  # the running row ends
    plan = tick(sched, lanes)
    assert plan.start_serial is serial and plan.step == "serial" and not plan.joins
    assert plan.waiting_for == "serial_lane" and ids(sched.pending) == ["late"]
    lanes.serial = None  # the serial request ends
    plan = tick(sched, lanes)
    assert plan.drain == "close" and ids(j.row for j in plan.joins) == ["late"]
    stats = sched.make_stats()
    assert stats.drain_open is None and stats.drains_total == 1
    assert stats.drains[0].request_id == "seeded" and stats.drains[0].rows_at_start == 1


def test_an_exclusive_command_waits_for_idle_lanes_and_runs_once():
    lanes = FakeLanes()
    sched = make(lanes)
    row = running(lanes, sched, FakeRow("first", [1] * 10))
    ran: list[str] = []
    sched.add_exclusive("load", lambda: ran.append("load"))
    add(sched, FakeRow("queued", [1] * 10))
    plan = tick(sched, lanes)
    assert plan.exclusive is None and plan.drain == "open" and not plan.joins
    lanes.rows.remove(row)
    plan = tick(sched, lanes)
    assert plan.exclusive is not None and not plan.joins
    plan.exclusive()
    assert ran == ["load"] and not sched.exclusive
    assert ids(j.row for j in tick(sched, lanes).joins) == ["queued"]


def test_the_plan_is_frozen_and_leaves_room_for_what_comes_next():
    plan = StepPlan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.step = "batch"  # type: ignore[misc]  # frozen on purpose
    join = Join(cast(Any, FakeRow("x", [1])), None)
    assert (join.draft_tokens, join.kv_bytes_per_token, join.position_offsets) == ((), 0, ())


# ------------------------------------------------------------ speculation's room


def test_a_verify_steps_room_is_the_budget_less_the_larger_of_projection_and_real_bytes():
    lanes = FakeLanes()
    sched = make(lanes, kv_budget=100_000)
    assert sched.spec_room(cast(Any, lanes)) == 100_000  # nothing running
    add(sched, FakeRow("a", [1] * 10))
    tick(sched, lanes)
    projected = sched.budget.batch_projection(cast(Any, lanes), sched.settings)
    assert 0 < projected < 100_000
    assert sched.spec_room(cast(Any, lanes)) == 100_000 - projected
    lanes.real_bytes = projected + 500  # real bytes past the projection (a draft cache)
    assert sched.spec_room(cast(Any, lanes)) == 100_000 - projected - 500
    lanes.real_bytes = 200_000  # over the budget: no room, never negative
    assert sched.spec_room(cast(Any, lanes)) == 0
