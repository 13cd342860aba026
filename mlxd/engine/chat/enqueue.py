"""Queuing a prepared request on its lane, or refusing it; preparing the queue again after a swap.

Runs on the engine thread. A request comes back from the intake thread
tokenized and checked (:func:`mlxd.engine.chat.intake.prepare`); here it
becomes a :class:`~mlxd.engine.chat.row.Row` in the batch or serial queue,
unless the engine stopped accepting, has no model, or too many wait already.
"""

from __future__ import annotations

import math
import time

from mlxd.engine.channel import Channel
from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.freeform import make_row_output
from mlxd.engine.chat.intake import Prepared, prepare
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.stops import TextStream
from mlxd.engine.messages import Accepted, Failed, GenerationRequest, Lane


def enqueue(
    core: EngineCore,
    request: GenerationRequest,
    channel: Channel,
    prepared: Prepared | Failed | None = None,
) -> None:
    """Queue a new request, or refuse it with a clear error.

    ``prepared`` is the request tokenized and checked by the intake
    thread; without it, the request is prepared here.
    """
    now_mono, now_wall = time.monotonic(), time.time()
    if not core.accepting:
        return core.refuse(channel, Failed("shutting_down", "the server is shutting down", 503))
    loaded = core.loaded
    if loaded is None:
        why = core.model_error or "the model is still loading"
        return core.refuse(channel, Failed("model_not_loaded", f"no model is loaded: {why}", 503))
    if prepared is None:
        prepared = prepare(loaded, request, core.settings, core.scheduler.room)
    if isinstance(prepared, Failed):
        return core.refuse(channel, prepared)
    depth = waiting(core)
    if _would_wait(core, prepared.decision.lane) and depth >= core.settings.limits.max_queued:
        message = f"{depth} requests are already waiting (limits.max_queued); retry later."
        return core.refuse(
            channel, Failed("queue_full", message, 429, retry_after=_retry_after(core, depth))
        )
    row = _row(loaded, request, channel, prepared, now_mono, now_wall)
    counters = core.counters
    counters.submitted += 1
    reasons = counters.lane_reasons
    reasons[row.reason] = reasons.get(row.reason, 0) + 1
    apis = counters.by_api
    apis[request.api] = apis.get(request.api, 0) + 1
    if request.constraint is not None:
        kinds = counters.constrained_rows
        kinds[request.constraint.kind] = kinds.get(request.constraint.kind, 0) + 1
    channel.push(Accepted(row.lane, row.reason, len(row.prompt), loaded.info.id))
    core.scheduler.add_request(row, now_mono)


def waiting(core: EngineCore) -> int:
    """Requests that wait for a slot: queued beyond what the lanes could start now.

    This is what ``[limits] max_queued`` bounds, so the bound holds
    whatever the arrival pattern (a burst that arrives before the next
    step is counted the same as a trickle).
    """
    free_batch, free_serial = _free_slots(core)
    sched = core.scheduler
    return max(0, len(sched.pending) - free_batch) + max(0, len(sched.serial_queue) - free_serial)


def prepare_queued_again(core: EngineCore) -> None:
    """After a model swap: queued requests are tokenized again by the new model.

    A request keeps the lane its client was told, unless the new model
    cannot batch; one that no longer fits is failed with the reason.
    """
    loaded = core.loaded
    assert loaded is not None
    sched = core.scheduler
    for row in sched.queued():
        if row.folded:  # its generated tokens are the old model's: it cannot go on
            sched.discard(row)
            message = (
                "the model was swapped while this request was paused for a more urgent "
                "one ([scheduling] preempt); its answer cannot go on with another model: "
                "retry it"
            )
            core.fail(row, message, code="model_not_loaded", status=503)
            continue
        prepared = prepare(loaded, row.request, core.settings, sched.room)
        if isinstance(prepared, Failed):
            sched.discard(row)
            message = f"the new model cannot take this request: {prepared.message}"
            core.fail(row, message, code=prepared.code, status=prepared.status)
            continue
        row.prompt, row.max_tokens, row.extent = (
            prepared.prompt,
            prepared.max_tokens,
            prepared.extent,
        )
        row.tokenizer = loaded.tokenizer
        row.text = TextStream(loaded.tokenizer.detokenizer, row.request.stop)
        row.output = make_row_output(loaded, row.request, prepared.phase)
        row.matcher = prepared.constraint
        row.system_end, row.prompt_end = prepared.system_end, prepared.prompt_end
        row.images = prepared.images
        row.prefetched = None
    if not loaded.capabilities.batchable:
        sched.to_serial("capability")


def _free_slots(core: EngineCore) -> tuple[int, int]:
    """Rows each lane could start now: free batch slots, and the serial slot."""
    running = len(core.batch) if core.batch is not None else 0
    return max(0, core.settings.batch.size - running), 0 if core.serial is not None else 1


def _would_wait(core: EngineCore, lane: Lane) -> bool:
    free_batch, free_serial = _free_slots(core)
    if lane == "batch":
        return len(core.scheduler.pending) >= free_batch
    return len(core.scheduler.serial_queue) >= free_serial


def _retry_after(core: EngineCore, depth: int) -> int:
    """Seconds until the queue has likely moved: its tokens over the observed rate."""
    rate = core.throughput.rates(time.time())["last_minute_tps"]
    if rate <= 0:
        return max(1, min(300, depth))
    return max(1, min(300, math.ceil(depth * core.avg_generated / rate)))


def _row(
    loaded: LoadedModel,
    request: GenerationRequest,
    channel: Channel,
    prepared: Prepared,
    now_mono: float,
    now_wall: float,
) -> Row:
    return Row(
        request=request,
        channel=channel,
        lane=prepared.decision.lane,
        reason=prepared.decision.reason,
        prompt=prepared.prompt,
        max_tokens=prepared.max_tokens,
        text=TextStream(loaded.tokenizer.detokenizer, request.stop),
        tokenizer=loaded.tokenizer,
        output=make_row_output(loaded, request, prepared.phase),
        matcher=prepared.constraint,
        received_mono=now_mono,
        received_wall=now_wall,
        extent=prepared.extent,
        system_end=prepared.system_end,
        prompt_end=prepared.prompt_end,
        images=prepared.images,
    )
