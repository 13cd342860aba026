"""Priority on the engine thread: the queues in the order admission takes them, and preemption.

The pure rules are :mod:`mlxd.engine.policy.priority`; this module applies
them to an :class:`~mlxd.engine.chat.core.EngineCore`:

- :func:`order_queues` sorts both queues before every admission pass;
- :func:`serial` and :func:`batch` make a running row yield to a more
  urgent waiting one (``[scheduling] preempt``): the row's cache goes into
  the prompt cache under its prompt plus the tokens it generated, those
  tokens become part of its prompt (:meth:`Row.fold`), and it goes back to
  the head of its class. Re-admitted, it is fetched from that cache like any
  request and goes on generating: its client sees a pause. Its text stream,
  output splitter, stop strings, logprobs and grammar matcher are the row's
  own objects and simply continue; ``max_tokens`` counts every token it made.

Rows that are not preempted: a row still prefilling (no token yet: nothing
to keep that the prompt cache would not keep anyway), a row with a ``seed``
(its random stream could not continue where it stopped), a row of a model
whose caches cannot be cut back (sliding-window or recurrent layers: its
kept cache holds its last token, which the resumed row must feed again, so
it would prefill everything again), a row that would not fit the KV budget
with its tokens as prompt, and every row of a cluster (the followers would
have to mirror it; ``ClusterHooks.preemption``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.row import Row
from mlxd.engine.policy import admission, priority
from mlxd.engine.snapshot import PreemptionEvent

logger = logging.getLogger(__name__)


def rules(core: EngineCore) -> priority.Rules:
    s = core.settings.scheduling
    return priority.Rules(fair_share=s.fair_share, aging_s=s.aging)


def running_by_key(core: EngineCore) -> dict[str, int]:
    """Rows running now, by API key name ("" without keys)."""
    counts: dict[str, int] = {}
    rows = list(core.batch.rows.values()) if core.batch is not None else []
    if core.serial is not None:
        rows.append(core.serial.row)
    for row in rows:
        counts[row.key] = counts.get(row.key, 0) + 1
    return counts


def order_queues(core: EngineCore) -> None:
    """Sort both queues into the order admission takes them (priority, fair share, FIFO)."""
    if len(core.pending) < 2 and len(core.serial_queue) < 2:
        return
    now, running, r = time.monotonic(), running_by_key(core), rules(core)
    for queue in (core.pending, core.serial_queue):
        if len(queue) > 1:
            rows = list(queue)
            waiting = [_waiting(x) for x in rows]
            queue.clear()
            order = priority.order(waiting, running, now, r, core.served)
            queue.extend(rows[i] for i in order)


def batch_outranks(core: EngineCore) -> bool:
    """Whether the head of the batch queue is more urgent than the serial queue's (both
    ordered), by the classes they are ordered by (aging included)."""
    if not core.pending or not core.serial_queue:
        return False
    now, r = time.monotonic(), rules(core)
    batch, serial = core.pending[0], core.serial_queue[0]
    return priority.effective(_waiting(batch), now, r) < priority.effective(
        _waiting(serial), now, r
    )


def _waiting(row: Row) -> priority.Waiting:
    return priority.Waiting(row.priority, row.key, row.seq, row.queued_mono, row.resumed)


def _enabled(core: EngineCore) -> bool:
    return core.settings.scheduling.preempt and getattr(core.hooks, "preemption", False)


def _preemptible(core: EngineCore, row: Row) -> bool:
    """Whether ``row`` may yield: decoding, unseeded, and sure to fit the budget when it resumes
    (its prompt then holds its generated tokens too)."""
    if (
        row.first_token_mono is None
        or row.request.sampling.seed is not None
        or row.cancelled
        or row.error is not None
        or row.generated >= row.max_tokens
        or core.loaded is None
        or not core.loaded.rewindable
    ):
        return False
    allowance = core.settings.batch.decode_allowance
    length = len(row.prompt) + row.generated - row.folded  # its prompt when it resumes
    resumed = admission.row_extent(length, row.tokens_left, allowance)
    step = core.settings.batch.prefill_step_size
    return admission.never_fits(core.loaded.layout, resumed, core.room.bytes, step) is None


def serial(core: EngineCore) -> bool:
    """The serial row yields to the head of either queue when that is more urgent.

    The serial lane runs alone, so a batch request waits for it too.
    """
    run = core.serial
    if run is None or not (core.serial_queue or core.pending) or not _enabled(core):
        return False
    heads = [q[0] for q in (core.serial_queue, core.pending) if q]
    waiter, row = min(heads, key=lambda h: priority.rank(h.priority)), run.row
    if priority.victim(waiter.priority, [_running(core, row)]) is None:
        return False
    run.close()
    core.serial = None
    _park(core, row, list(row.prompt) + row.generated_ids[row.folded :], run.cache, waiter)
    core.serial_queue.appendleft(row)
    order_queues(core)
    return True


def batch(core: EngineCore) -> bool:
    """A batch row yields to the head of the pending queue, which admission just refused."""
    lane = core.batch
    if lane is None or not len(lane) or not core.pending or not _enabled(core):
        return False
    waiter = core.pending[0]
    rows = list(lane.rows.values())
    index = priority.victim(waiter.priority, [_running(core, r) for r in rows])
    if index is None:
        return False
    row = rows[index]
    assert row.uid is not None
    caches = lane.remove([row], return_caches=True)
    cache, tokens = caches.get(row.uid, (None, None))
    _park(core, row, list(tokens) if tokens is not None else None, cache, waiter)
    core.pending.appendleft(row)
    order_queues(core)
    core.note_kv(after_step=False)
    return True


def _running(core: EngineCore, row: Row) -> priority.Running:
    return priority.Running(row.priority, row.started_mono, _preemptible(core, row))


def _park(core: EngineCore, row: Row, tokens: list[int] | None, cache: Any, by: Row) -> None:
    """Keep ``row``'s cache, fold its tokens into its prompt, count and log the preemption."""
    generated = row.generated
    row.fold()
    if tokens is not None and cache is not None:
        core.store_cache(tokens, cache)
    allowance = core.settings.batch.decode_allowance
    row.extent = admission.row_extent(len(row.prompt), row.tokens_left, allowance)
    c = core.counters
    c.preemptions += 1
    c.preemptions_by_key[row.key] = c.preemptions_by_key.get(row.key, 0) + 1
    event = PreemptionEvent(
        time.time(),
        row.lane,
        row.id,
        row.request.client,
        row.priority,
        generated,
        by.id,
        by.priority,
    )
    core.preemptions.append(event)
    logger.info(
        "preempted %s (%s, key %s) after %d tokens for %s (%s); it resumes from its kept cache",
        row.id,
        row.priority,
        row.key or "-",
        generated,
        by.id,
        by.priority,
    )
