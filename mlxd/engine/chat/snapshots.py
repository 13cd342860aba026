"""Building the immutable :class:`Snapshot` from the engine thread's state."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mlxd.engine.cluster_status import ClusterStatus
from mlxd.engine.policy import admission
from mlxd.engine.snapshot import (
    BatchState,
    RunningRow,
    ServedModel,
    Snapshot,
    WaitingRequest,
)

if TYPE_CHECKING:
    from mlxd.engine.chat.core import EngineCore
    from mlxd.engine.chat.row import Row


def _running_row(row: Row, now: float, kv_bytes: int, projected: int) -> RunningRow:
    return RunningRow(
        id=row.id,
        api=row.request.api,
        lane=row.lane,
        phase=row.phase,
        prompt_tokens=row.prompt_tokens,
        cached_tokens=row.cached_tokens,
        prefill_done=row.prefill_done,
        prefill_total=row.prefill_total,
        generated_tokens=row.generated,
        max_tokens=row.max_tokens,
        tokens_per_s=round(row.tokens_per_s(now), 2),
        received_at=row.received_wall,
        kv_bytes=kv_bytes,
        projected_kv_bytes=projected,
        constraint=row.request.constraint.kind if row.request.constraint else None,
        output={"normal": "answer"}.get(row.output.phase, row.output.phase),
        priority=row.priority,
        key=row.request.client,
        preemptions=row.preemptions,
        images=row.images.count if row.images is not None else 0,
        image_tokens=len(row.images.ids) if row.images is not None else 0,
        spec_drafted_tokens=row.spec_drafted,
        spec_accepted_tokens=row.spec_accepted,
    )


def _speculation(core: EngineCore) -> dict[str, Any]:
    """The batch lane's speculation now: mode in effect, last depth, measured acceptance."""
    if core.batch is None:  # no batch lane yet: the mode its first row will step with
        return {"spec_mode": core.settings.speculative.mode}
    spec = core.batch.speculator
    if spec is None:  # a cluster's lane does not speculate
        return {}
    return {
        "spec_mode": spec.settings.mode,
        "spec_depth": spec.depth,
        "spec_acceptance": round(spec.acceptance.rate, 3),
        "spec_cache_bytes": spec.cache_bytes(),
    }


def build_snapshot(
    core: EngineCore, *, state: str, cluster: ClusterStatus | None = None
) -> Snapshot:
    """One consistent, immutable view of ``core``; called on the engine thread."""
    now, wall = time.monotonic(), time.time()
    settings = core.settings
    loaded = core.loaded
    layout = loaded.layout if loaded else None
    step = settings.batch.prefill_step_size
    sched = core.scheduler.make_stats()

    rows: list[RunningRow] = []
    batch_rows = list(core.batch.rows.values()) if core.batch is not None else []
    batch_bytes = core.batch.nbytes if core.batch is not None else 0
    projected = core.scheduler.budget.batch_projection(core.lanes, settings)
    n = max(len(batch_rows), 1)
    rows.extend(_running_row(r, now, batch_bytes // n, projected // n) for r in batch_rows)
    serial_bytes = 0
    if core.serial is not None:
        serial_bytes = core.serial.nbytes
        row = core.serial.row
        alone = admission.alone_bytes(layout, row.projected(), step) if layout else 0
        rows.append(_running_row(row, now, serial_bytes, alone))
        projected += alone

    pending = []
    blocked = sched.waiting_for or "batch_full"
    for row in sched.pending:
        alone = admission.alone_bytes(layout, row.extent, step) if layout else 0
        pending.append(
            WaitingRequest(
                row.id,
                row.request.api,
                "batch",
                row.received_wall,
                row.prompt_tokens,
                alone,
                "stalled" if row.stalled else blocked,
                row.priority,
                row.request.client,
                row.preemptions > 0,
            )
        )
    for row in sched.serial_queue:
        alone = admission.alone_bytes(layout, row.extent, step) if layout else 0
        pending.append(
            WaitingRequest(
                row.id,
                row.request.api,
                "serial",
                row.received_wall,
                row.prompt_tokens,
                alone,
                "serial_lane",
                row.priority,
                row.request.client,
                row.preemptions > 0,
            )
        )

    live = batch_bytes + serial_bytes
    info = loaded.info if loaded else None
    batched = settings.batch.size > 1 and bool(info and info.batchable)
    open_drain = sched.drain_open
    return Snapshot(
        taken_at=wall,
        started_at=core.started_wall,
        state=state,
        model=ServedModel(
            name=info.id if info else None,
            path=info.path if info else None,
            family=info.family if info else None,
            context=info.context_length if info else None,
            batchable=bool(info and info.batchable),
            cache_kinds=info.cache_kinds if info else (),
            status=core.model_status,
            error=core.model_error,
            vocab_size=info.vocab_size if info else None,
            dtype=info.dtype if info else None,
            weights_bytes=info.weights_bytes if info else 0,
        ),
        mode="batch" if settings.batch.size > 1 else "serial",
        batch=BatchState(
            configured=settings.batch.size,
            batched=batched,
            active_rows=len(rows),
            pending_rows=len(pending),
            prefilling_rows=sum(1 for r in rows if r.phase == "prefill"),
            kv_bytes=live,
            kv_projected_bytes=projected,
            kv_budget_bytes=sched.budget_bytes,
            kv_budget_auto=settings.batch.kv_budget == "auto",
            max_active_rows_seen=core.max_active_seen,
            max_kv_bytes_seen=sched.max_kv_seen,
            admission_paused=open_drain.reason if open_drain else None,
            **_speculation(core),
            kv_bits=loaded.kv_quant[0] if loaded and loaded.kv_quant else 0,
            kv_bytes_per_token=loaded.layout.bytes_per_token if loaded else 0,
            kv_unquantized_bytes_per_token=loaded.kv_plain_bytes_per_token if loaded else 0,
        ),
        rows=tuple(rows),
        pending=tuple(pending),
        drains=sched.drains,
        prompt_cache=replace(
            core.prompt_cache.state(core.counters.cached_tokens), rules=dict(core.rule_counts)
        ),
        counters={
            **core.counters.as_dict(),
            "drains": sched.drains_total,
            "drain_paused_seconds": round(sched.drain_paused_s, 3),
        },
        throughput=core.throughput.rates(wall),
        runtime=dict(core.runtime),
        last_step_at=core.last_step_wall,
        last_error=core.last_error,
        last_error_at=core.last_error_at,
        memory=core.memory(),
        history=core.peaks.history(wall),
        busy=core.busy or core.intaking > 0,
        cluster=cluster,
        stall=sched.stall,
        lookups=tuple(core.lookups),
        preemptions=sched.preemptions,
    )
