"""Priority over queued and running rows: the order admission takes them, and who yields.

The pure rules are :mod:`mlxd.engine.policy.priority`; these helpers turn the
scheduler's rows into its values (:class:`~mlxd.engine.policy.priority.Waiting`,
:class:`~mlxd.engine.policy.priority.Running`) and back. Which rows may yield
(docs/batching.md, "Preemption"): a decoding, unseeded row of a model whose
caches can be cut back, sure to fit the KV budget when it resumes with its
tokens as prompt, and never in a cluster (:meth:`Lanes.preemption
<mlxd.engine.chat.step_plan.Lanes.preemption>`). No MLX.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mlxd.config import Settings
from mlxd.engine.policy import admission, priority
from mlxd.engine.snapshot import PreemptionEvent

if TYPE_CHECKING:
    from mlxd.engine.chat.row import Row


logger = logging.getLogger(__name__)


def rules(settings: Settings) -> priority.Rules:
    s = settings.scheduling
    return priority.Rules(fair_share=s.fair_share, aging_s=s.aging)


def by_key(rows: Sequence[Row]) -> dict[str, int]:
    """Rows running now, by API key name ("" without keys)."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.key] = counts.get(row.key, 0) + 1
    return counts


def waiting(row: Row, parked: Mapping[int, float] | None = None) -> priority.Waiting:
    """``row`` as the order sees it; ``parked``: rows preempted in this tick, by ``id(row)``,
    with the time they yielded (they are folded once the step carries the plan out)."""
    if parked and id(row) in parked:
        return priority.Waiting(row.priority, row.key, row.seq, parked[id(row)], True)
    return priority.Waiting(row.priority, row.key, row.seq, row.queued_mono, row.resumed)


def sort(
    queue: deque[Row],
    running: Mapping[str, int],
    now: float,
    r: priority.Rules,
    served: Mapping[str, float],
    parked: Mapping[int, float] | None = None,
) -> None:
    """Sort ``queue`` in place into the order admission takes it (``parked``: :func:`waiting`)."""
    if len(queue) < 2:
        return
    rows = list(queue)
    items = [waiting(x, parked) for x in rows]
    queue.clear()
    queue.extend(rows[i] for i in priority.order(items, running, now, r, served))


def outranks(
    batch: Row,
    serial: Row,
    now: float,
    r: priority.Rules,
    parked: Mapping[int, float] | None = None,
) -> bool:
    """Whether the batch queue's head is more urgent than the serial queue's (aging included)."""
    ours, theirs = waiting(batch, parked), waiting(serial, parked)
    return priority.effective(ours, now, r) < priority.effective(theirs, now, r)


def preemptible(
    row: Row, settings: Settings, layout: admission.CacheLayout | None, budget: int
) -> bool:
    """Whether ``row`` may yield: decoding, unseeded, and sure to fit the budget when it resumes
    (its prompt then holds its generated tokens too). ``layout`` is None when caches cannot
    be cut back."""
    if (
        row.first_token_mono is None
        or row.request.sampling.seed is not None
        or row.cancelled
        or row.error is not None
        or row.generated >= row.max_tokens
        or layout is None
    ):
        return False
    allowance = settings.batch.decode_allowance
    length = len(row.prompt) + row.generated - row.folded  # its prompt when it resumes
    resumed = admission.row_extent(length, row.tokens_left, allowance)
    step = settings.batch.prefill_step_size
    return admission.never_fits(layout, resumed, budget, step) is None


def victim(
    waiter: Row,
    rows: Sequence[Row],
    settings: Settings,
    layout: admission.CacheLayout | None,
    budget: int,
    started: Mapping[int, float] | None = None,
) -> Row | None:
    """The running row that yields to ``waiter``, if any (``started``: start times by
    ``id(row)`` for rows that join this tick)."""
    started = started or {}
    running = [
        priority.Running(
            r.priority,
            started.get(id(r), r.started_mono),
            preemptible(r, settings, layout, budget),
        )
        for r in rows
    ]
    index = priority.victim(waiter.priority, running)
    return None if index is None else rows[index]


def yielded(row: Row, by: Row) -> PreemptionEvent:
    """The record of ``row`` yielding to ``by`` (logged: the operator sees each preemption)."""
    logger.info(
        "preempted %s (%s, key %s) after %d tokens for %s (%s); it resumes from its kept cache",
        row.id,
        row.priority,
        row.key or "-",
        row.generated,
        by.id,
        by.priority,
    )
    return PreemptionEvent(
        time.time(),
        row.lane,
        row.id,
        row.request.client,
        row.priority,
        row.generated,
        by.id,
        by.priority,
    )
