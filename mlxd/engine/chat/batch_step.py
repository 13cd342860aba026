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
from dataclasses import replace

from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.row import Row
from mlxd.engine.policy import admission

logger = logging.getLogger(__name__)


def admit(core: EngineCore) -> None:
    """Move pending rows into the batch while they fit; say why the rest wait."""
    loaded = core.loaded
    assert loaded is not None
    core.waiting_for = None
    if not core.pending:
        return
    if core.batch is None:
        core.batch = core.hooks.make_batch_lane(loaded, core.settings.batch, faults=core.faults)
    batch, layout = core.batch, loaded.layout
    step = core.settings.batch.prefill_step_size
    pool = core.pool
    while core.pending:
        row = core.pending[0]
        if row.prefetched is None:
            row.prefetched = core.fetch_cache(row.prompt)
        fetched = row.prefetched
        cache, rest = fetched.cache, fetched.rest
        row.extent = replace(row.extent, cached=len(row.prompt) - len(rest))
        check = admission.check_admission(
            layout,
            [r.extent for r in batch.rows.values()],
            row.extent,
            batch_size=core.settings.batch.size,
            budget=core.admission_budget(),
            real_bytes=batch.nbytes,
            prefill_step_size=step,
        )
        if not check.admit:
            core.waiting_for = check.waiting_for
            return
        if pool is not None and not pool.claim_kv(
            core.pool_id, core.kv_claim(max(check.projected_bytes, batch.nbytes))
        ):
            core.waiting_for = "budget"  # another model claimed it in the meantime
            return
        core.pending.popleft()
        row.prefetched = None
        core.admit_lookup(row, fetched)
        try:
            batch.insert(row, cache, rest)
        except Exception as exc:
            logger.exception("inserting %s into the batch", row.id)
            core.fail(row, f"could not start generation: {exc}")
            continue
        core.last_turn = "batch"
        core.max_active_seen = max(core.max_active_seen, len(batch))
        core.prompt_cache.trim(core.live_bytes())


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
    core.max_kv_seen = max(core.max_kv_seen, batch.nbytes)


def _failed(core: EngineCore, exc: Exception) -> None:
    logger.exception("the batched step failed; failing its rows and rebuilding the batch")
    core.counters.engine_errors += 1
    core.note_error(f"batched step failed: {exc!r}")
    assert core.batch is not None
    for row in core.batch.reset(core.settings.batch):
        core.fail(row, f"the batched forward failed ({exc}); the engine recovered")
