"""The batch lane's turn: inserting the rows the scheduler admitted, and one batched step.

Runs on the engine thread over an :class:`~mlxd.engine.chat.core.EngineCore`.
Which rows join, and from which cache hit, is the scheduler's plan
(:mod:`mlxd.engine.chat.admit`); a step turns the generator's tokens into
events and ends the rows that finished, hit a stop string or failed alone.
"""

from __future__ import annotations

import logging
import time

from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.step_plan import Join

logger = logging.getLogger(__name__)


def admit(core: EngineCore, joins: tuple[Join, ...]) -> None:
    """Insert the rows the plan admits into the batch, each from its planned cache hit."""
    if joins:
        loaded = core.loaded
        assert loaded is not None
        if core.batch is None:
            core.batch = core.hooks.make_batch_lane(loaded, core.settings.batch, faults=core.faults)
            core.batch.speculate(core.settings.speculative)
        batch = core.batch
        for join in joins:
            row = join.row
            core.admit_lookup(row, join.hit)
            try:
                batch.insert(row, join.hit.cache, join.hit.rest)
            except Exception as exc:
                logger.exception("inserting %s into the batch", row.id)
                core.fail(row, f"could not start generation: {exc}")
                continue
            core.max_active_seen = max(core.max_active_seen, len(batch))
            core.prompt_cache.trim(core.live_bytes())
    core.note_kv(after_step=False)


def step(core: EngineCore) -> None:
    """One batched step; every row's token goes out, ended rows leave the batch."""
    batch = core.batch
    assert batch is not None
    spec = batch.speculator
    if spec is not None and spec.settings.mode != "off":
        spec.room = core.scheduler.spec_room(core.lanes)
    try:
        with batch.stats() as stats:
            outs = batch.step()
    except Exception as exc:
        _failed(core, exc)
        return
    core.counters.prefill_seconds += stats.prompt_time
    core.counters.decode_seconds += stats.decode_time
    if batch.speculator is not None:
        tally = batch.speculator.take()
        core.counters.spec_drafted_tokens += tally.drafted
        core.counters.spec_accepted_tokens += tally.accepted
        core.counters.spec_verify_steps += tally.steps
    for taken in batch.checkpoints:
        core.store_checkpoint(taken.tokens, taken.cache, taken.kind)
    batch.checkpoints = []
    core.last_step_wall = time.time()
    early: list[Row] = []
    for out in outs:
        row = out.row
        if early and row in early:
            continue  # a speculative step's tokens after a stop string (or a failure)
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
