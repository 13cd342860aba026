"""Preemption carried out: a running row that the scheduler picked yields its place.

Which row yields, to whom, and where it waits are the scheduler's
(:mod:`mlxd.engine.chat.scheduler`, :mod:`mlxd.engine.chat.ranking`); this
module does the MLX side on the engine thread (``[scheduling] preempt``,
docs/batching.md, "Preemption"): the row's cache goes into the prompt cache
under its prompt plus the tokens it generated, those tokens become part of
its prompt (:meth:`Row.fold`), and it waits at the head of its class.
Re-admitted, it is fetched from that cache like any request and goes on
generating: its client sees a pause. Its text stream, output splitter, stop
strings, logprobs and grammar matcher are the row's own objects and simply
continue; ``max_tokens`` counts every token it made.
"""

from __future__ import annotations

from typing import Any

from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.step_plan import Preempted
from mlxd.engine.policy import admission


def serial(core: EngineCore, preempted: Preempted) -> None:
    """The serial row yields: its run closes, its cache is kept."""
    run = core.serial
    assert run is not None and run.row is preempted.row
    row = run.row
    run.close()
    core.serial = None
    _park(core, row, list(row.prompt) + row.generated_ids[row.folded :], run.cache)


def batch(core: EngineCore, preempted: Preempted) -> None:
    """A batch row yields: it leaves the batch with its cache, which is kept."""
    lane, row = core.batch, preempted.row
    assert lane is not None and row.uid is not None
    caches = lane.remove([row], return_caches=True)
    cache, tokens = caches.get(row.uid, (None, None))
    _park(core, row, list(tokens) if tokens is not None else None, cache)
    core.note_kv(after_step=False)


def _park(core: EngineCore, row: Row, tokens: list[int] | None, cache: Any) -> None:
    """Keep ``row``'s cache, fold its tokens into its prompt, count the preemption."""
    row.fold()
    if tokens is not None and cache is not None:
        core.store_cache(tokens, cache)
    allowance = core.settings.batch.decode_allowance
    row.extent = admission.row_extent(len(row.prompt), row.tokens_left, allowance)
    c = core.counters
    c.preemptions += 1
    c.preemptions_by_key[row.key] = c.preemptions_by_key.get(row.key, 0) + 1
