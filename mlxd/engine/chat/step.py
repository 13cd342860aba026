"""One pass of the engine: carry out the scheduler's plan, then run one step.

:meth:`Scheduler.schedule <mlxd.engine.chat.scheduler.Scheduler.schedule>`
decides what this tick does (:class:`~mlxd.engine.chat.step_plan.StepPlan`);
this module carries it out on the engine thread, in the plan's order: a
preempted serial row yields, an exclusive command runs, the serial row
starts, rows join the batch, a preempted batch row yields and rows join in
its place; then the lane the plan names steps. It decides no policy.
"""

from __future__ import annotations

from mlxd.engine.chat import batch_step, preempt, serial_step
from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.step_plan import StepPlan


def tick(core: EngineCore) -> bool:
    """Plan the lanes, admit, run one step. Returns True if a step ran."""
    if core.loaded is None and not core.scheduler.exclusive:
        return False
    plan = core.scheduler.schedule(core.lanes)
    execute(core, plan)
    if plan.step == "serial" and core.serial is not None:
        serial_step.step(core)
    elif plan.step == "batch" and core.batch is not None and len(core.batch):
        batch_step.step(core)
    else:
        return False
    if core.scheduler.drains.open is not None and core.serial is None:
        # A serial request just ended: admission may resume now, not next tick.
        execute(core, core.scheduler.schedule(core.lanes))
    return True


def execute(core: EngineCore, plan: StepPlan) -> None:
    """Carry out ``plan`` (see :class:`~mlxd.engine.chat.step_plan.StepPlan` for the order)."""
    if plan.preempt_serial is not None:
        preempt.serial(core, plan.preempt_serial)
    if plan.exclusive is not None:
        plan.exclusive()
    if plan.start_serial is not None:
        serial_step.start(core, plan.start_serial, plan.serial_hit)
    batch_step.admit(core, plan.joins)
    if plan.preempt_batch is not None:
        preempt.batch(core, plan.preempt_batch)
        batch_step.admit(core, plan.rejoins)
