"""One pass of the engine: plan the lanes' turns, admit, run one step.

The pure drain plan (:func:`mlxd.engine.policy.drain.plan`) says whose turn
it is; this module carries it out on the engine thread: it opens and closes
drains, runs an exclusive command once both lanes are idle, starts the
serial row, admits into the batch, then steps one lane.
"""

from __future__ import annotations

import time

from mlxd.engine.chat import batch_step, preempt, serial_step
from mlxd.engine.chat.core import EngineCore
from mlxd.engine.policy.drain import LaneState, plan


def tick(core: EngineCore) -> bool:
    """Plan the lanes, admit, run one step. Returns True if a step ran."""
    if core.loaded is None and not core.exclusive:
        return False
    _plan_and_start(core)
    if core.serial is not None:
        serial_step.step(core)
    elif core.batch is not None and len(core.batch):
        batch_step.step(core)
    else:
        return False
    if core.drains.open is not None and core.serial is None:
        # A serial request just ended: admission may resume now, not next tick.
        _plan_and_start(core)
    return True


def _plan_and_start(core: EngineCore) -> None:
    preempt.order_queues(core)
    preempt.serial(core)
    running = len(core.batch) if core.batch is not None else 0
    p = plan(
        LaneState(
            batch_running=running,
            batch_pending=len(core.pending),
            serial_waiting=len(core.serial_queue),
            serial_running=core.serial is not None,
            exclusive_waiting=bool(core.exclusive),
            last_turn=core.last_turn,
            batch_outranks=preempt.batch_outranks(core),
        )
    )
    now, wall = time.monotonic(), time.time()
    if p.draining and core.drains.open is None:
        if core.exclusive:
            reason, request_id = core.exclusive[0][0], None
        else:
            reason, request_id = core.serial_queue[0].reason, core.serial_queue[0].id
        core.drains.start(reason, request_id, running, wall=wall, mono=now)
    if p.run_exclusive:
        _, run = core.exclusive.popleft()
        core.drains.waiter_started(mono=now)
        run()
    if p.start_serial:
        core.drains.waiter_started(mono=now)
        serial_step.start(core, core.serial_queue.popleft())
    if p.admit_batch:
        core.drains.end(wall=wall, mono=now)
        batch_step.admit(core)
        if preempt.batch(core):
            batch_step.admit(core)
    else:
        core.waiting_for = p.batch_blocked_by
