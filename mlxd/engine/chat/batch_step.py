"""The batch lane's turn: admitting pending rows under the KV budget, and one batched step.

Runs on the engine thread over an :class:`~mlxd.engine.chat.core.EngineCore`.
Admission takes the head of the pending queue while the pure rule
(:func:`mlxd.engine.policy.admission.check_admission`) and the shared
memory pool allow it; a step turns the generator's tokens into events and
ends the rows that finished, hit a stop string or failed alone.
"""

from __future__ import annotations

import logging
import time

from mlxd.config import format_bytes
from mlxd.engine.chat import replan
from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.row import Row
from mlxd.engine.policy import admission
from mlxd.engine.policy.admission import Admission

logger = logging.getLogger(__name__)


def admit(core: EngineCore) -> None:
    """Move pending rows into the batch while they fit; say why the rest wait.

    The queue is FIFO: the first row that does not fit stops admission,
    unless it is stalled (refused on an idle lane, see
    :mod:`mlxd.engine.policy.stalls`): then the rows behind it may still
    join, in their order.
    """
    loaded = core.loaded
    assert loaded is not None
    core.waiting_for = None
    if not core.pending:
        return
    if core.batch is None:
        core.batch = core.hooks.make_batch_lane(loaded, core.settings.batch, faults=core.faults)
    batch = core.batch
    blocking: tuple[Row, Admission] | None = None  # the row that stopped admission
    raced = False
    index = 0
    while index < len(core.pending):
        row = core.pending[index]
        if row.prefetched is None:
            row.prefetched = core.fetch_cache(row.prompt)
        # Planned on every pass: the budget may have shrunk since the lookup.
        fetched = replan.plan_cache(core, row, row.prefetched)
        if fetched is None:  # it can never fit the budget: refused
            del core.pending[index]
            continue
        row.prefetched = fetched
        check = _check(core, row)
        if check.admit and not _claim(core, check):
            core.waiting_for, raced = "budget", True  # another model claimed it meanwhile
            break
        if not check.admit:
            core.waiting_for = core.waiting_for or check.waiting_for
            if row.stalled is None:
                blocking = (row, check)
                break
            index += 1
            continue
        del core.pending[index]
        row.prefetched = None
        core.admit_lookup(row, fetched)
        try:
            batch.insert(row, fetched.cache, fetched.rest)
        except Exception as exc:
            logger.exception("inserting %s into the batch", row.id)
            core.fail(row, f"could not start generation: {exc}")
            continue
        core.last_turn = "batch"
        core.max_active_seen = max(core.max_active_seen, len(batch))
        core.prompt_cache.trim(core.live_bytes())
    _watch(core, None if raced else blocking)
    core.note_kv(after_step=False)


def _check(core: EngineCore, row: Row) -> Admission:
    batch, loaded = core.batch, core.loaded
    assert batch is not None and loaded is not None
    check = admission.check_admission(
        loaded.layout,
        [r.projected() for r in batch.rows.values()],
        row.projected(),
        batch_size=core.settings.batch.size,
        budget=core.admission_budget(),
        real_bytes=batch.nbytes,
        prefill_step_size=core.settings.batch.prefill_step_size,
        prompt_concurrency=core.settings.batch.prompt_concurrency,
    )
    if core.faults and row.request.fault == "never_admit":
        return Admission(False, "budget", check.projected_bytes)  # a stand-in for a wedge bug
    return check


def _claim(core: EngineCore, check: Admission) -> bool:
    """Raise this model's claim on a shared memory pool to cover the admitted batch."""
    batch, pool = core.batch, core.pool
    if pool is None or batch is None:
        return True
    return pool.claim_kv(core.pool_id, core.kv_claim(max(check.projected_bytes, batch.nbytes)))


def _watch(core: EngineCore, blocking: tuple[Row, Admission] | None) -> None:
    """Tell the stall watch whether a row was refused on an idle lane with its budget free."""
    idle = core.lane_idle() and core.admission_budget() >= core.budget_bytes
    stuck = blocking if blocking is not None and idle else None
    if not core.stalls.observe(stuck[0].id if stuck else None, time.monotonic()) or not stuck:
        return
    row, check = stuck
    row.stalled = (
        f"request {row.id} waits for {check.waiting_for} while the batch is idle (it projects "
        f"{format_bytes(check.projected_bytes)} of KV cache, the budget is "
        f"{format_bytes(core.budget_bytes)}); the requests behind it are admitted past it"
    )
    logger.error("admission stalled: %s; this is a bug, please report it", row.stalled)


def step(core: EngineCore) -> None:
    """One batched step; every row's token goes out, ended rows leave the batch."""
    batch = core.batch
    assert batch is not None
    try:
        with batch.stats() as stats:
            outs = batch.step()
    except Exception as exc:
        _failed(core, exc)
        return
    core.counters.prefill_seconds += stats.prompt_time
    core.counters.decode_seconds += stats.decode_time
    for taken in batch.checkpoints:
        core.store_checkpoint(taken.tokens, taken.cache, taken.kind)
    batch.checkpoints = []
    core.last_step_wall = time.time()
    early: list[Row] = []
    for out in outs:
        row = out.row
        stopped = False
        if row.error is None:
            try:
                is_eos = out.finish_reason == "stop"
                stopped = row.push_token(out.token, out.logprobs, is_eos=is_eos)
            except Exception as exc:  # a detokenizer failing for this row alone
                row.error = exc
        if row.error is not None:
            if out.finish_reason is None:
                early.append(row)
            else:
                core.fail(row, f"generation failed for this request: {row.error}")
            continue
        if out.finish_reason is not None:
            core.complete(row, "stop" if out.finish_reason == "stop" else "length")
            core.store_cache(out.all_tokens, out.cache)
        elif stopped:
            early.append(row)
    core.throughput.add(len(outs), time.time())
    if early:
        caches = batch.remove(early, return_caches=True)
        for row in early:
            if row.error is not None:
                core.fail(row, f"generation failed for this request: {row.error}")
                continue
            core.complete(row, "stop", stopped_by_string=True)
            cache, tokens = (
                caches.get(row.uid, (None, None)) if row.uid is not None else (None, None)
            )
            core.store_cache(tokens, cache)
    # Rows whose processor failed this step may not have produced a token.
    failed = [r for r in batch.rows.values() if r.error is not None]
    if failed:
        batch.remove(failed)
        for row in failed:
            core.fail(row, f"generation failed for this request: {row.error}")
    core.note_kv(after_step=True)


def _failed(core: EngineCore, exc: Exception) -> None:
    logger.exception("the batched step failed; failing its rows and rebuilding the batch")
    core.counters.engine_errors += 1
    core.note_error(f"batched step failed: {exc!r}")
    assert core.batch is not None
    for row in core.batch.reset(core.settings.batch):
        core.fail(row, f"the batched forward failed ({exc}); the engine recovered")
