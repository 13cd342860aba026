"""plan() and DrainLog: how the lanes take turns, and the drain record (pure)."""

from __future__ import annotations

from mlxd.engine.policy.drain import DrainLog, LaneState, plan


def state(**kw):
    base = dict(
        batch_running=0, batch_pending=0, serial_waiting=0, serial_running=False,
        exclusive_waiting=False, last_turn="batch",
    )  # fmt: skip
    return LaneState(**{**base, **kw})


def test_idle_admits_batch():
    p = plan(state())
    assert p.admit_batch and not p.start_serial and not p.draining


def test_serial_waiting_behind_running_rows_drains():
    p = plan(state(batch_running=3, batch_pending=2, serial_waiting=1))
    assert not p.admit_batch and not p.start_serial
    assert p.draining and p.batch_blocked_by == "drain"


def test_serial_starts_once_rows_finished():
    p = plan(state(batch_running=0, batch_pending=2, serial_waiting=1, last_turn="batch"))
    assert p.start_serial and not p.admit_batch and p.batch_blocked_by == "serial_lane"


def test_batch_gets_a_turn_after_a_serial_request_when_both_lanes_wait():
    p = plan(state(batch_pending=2, serial_waiting=1, last_turn="serial"))
    assert p.admit_batch and not p.start_serial


def test_serial_requests_run_back_to_back_without_batch_demand():
    p = plan(state(serial_waiting=2, last_turn="serial"))
    assert p.start_serial


def test_nothing_is_admitted_while_serial_runs():
    p = plan(state(serial_running=True, batch_pending=4))
    assert not p.admit_batch and not p.start_serial and p.batch_blocked_by == "serial_lane"


def test_exclusive_waits_for_both_lanes_then_runs():
    p = plan(state(exclusive_waiting=True, batch_running=1, serial_waiting=1, batch_pending=1))
    assert not (p.admit_batch or p.start_serial or p.run_exclusive) and p.draining
    p = plan(state(exclusive_waiting=True, serial_running=True))
    assert not p.run_exclusive
    p = plan(state(exclusive_waiting=True, serial_waiting=1, batch_pending=3))
    assert p.run_exclusive and not p.admit_batch and not p.start_serial


def test_alternation_under_endless_load_on_both_lanes():
    """Simulate: batch rows finish one step after admission, serial takes one step."""
    turns = []
    last = "batch"
    running = serial = 0
    for _ in range(12):
        p = plan(
            state(
                batch_running=running,
                batch_pending=5,
                serial_waiting=5,
                serial_running=bool(serial),
                last_turn=last,
            )
        )
        if p.admit_batch:
            turns.append("batch")
            running, last = 2, "batch"
        elif p.start_serial:
            turns.append("serial")
            serial, last = 1, "serial"
        else:
            running, serial = 0, 0  # the running work finishes
    assert turns[:4] == ["serial", "batch", "serial", "batch"]


def test_drain_log_records_waits_and_keeps_newest_first():
    log = DrainLog(size=2)
    log.start("seed", "r1", 3, wall=100.0, mono=10.0)
    log.start("seed", "r2", 1, wall=100.5, mono=10.5)  # already draining: no second event
    assert log.open is not None and log.open.request_id == "r1"
    log.waiter_started(mono=12.0)
    event = log.end(wall=105.0, mono=15.0)
    assert event is not None
    assert (event.rows_at_start, event.serial_wait_s, event.paused_s) == (3, 2.0, 5.0)
    assert event.started_at == 100.0 and event.ended_at == 105.0
    for i in range(3):
        log.start("logprobs", f"x{i}", 1, wall=200.0 + i, mono=20.0 + i)
        log.end(wall=201.0 + i, mono=21.0 + i)
    assert [e.request_id for e in log.events()] == ["x2", "x1"]  # bounded, newest first
    assert log.total == 4


def test_end_without_waiter_counts_the_whole_pause_as_wait():
    log = DrainLog()
    log.start("model_swap", None, 2, wall=0.0, mono=0.0)
    event = log.end(wall=3.0, mono=3.0)
    assert event.serial_wait_s == 3.0 and event.paused_s == 3.0
    assert log.end(wall=4.0, mono=4.0) is None


def test_a_more_urgent_batch_request_is_admitted_instead_of_draining():
    p = plan(state(batch_running=2, batch_pending=1, serial_waiting=1, batch_outranks=True))
    assert p.admit_batch and not p.draining and not p.start_serial


def test_a_more_urgent_batch_request_goes_first_when_both_lanes_are_idle():
    p = plan(state(batch_pending=1, serial_waiting=1, last_turn="batch", batch_outranks=True))
    assert p.admit_batch and not p.start_serial


def test_the_serial_waiter_drains_once_nothing_more_urgent_waits():
    # Nothing pending outranks it (or aging lifted it level): the drain rule applies.
    for pending in (0, 2):
        p = plan(state(batch_running=2, batch_pending=pending, serial_waiting=1))
        assert p.draining and not p.admit_batch
    p = plan(state(batch_running=2, batch_pending=0, serial_waiting=1, batch_outranks=True))
    assert p.draining  # outranking needs a batch request to admit


def test_priority_never_overrides_an_exclusive_call_or_a_running_serial_row():
    p = plan(state(exclusive_waiting=True, batch_pending=1, serial_waiting=1, batch_outranks=True))
    assert not p.admit_batch
    p = plan(state(serial_running=True, batch_pending=1, serial_waiting=1, batch_outranks=True))
    assert not p.admit_batch and p.batch_blocked_by == "serial_lane"
