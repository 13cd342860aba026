"""A queued request planned against the KV budget when it leaves its queue.

Runs on the engine thread over an :class:`~mlxd.engine.chat.core.EngineCore`
(docs/batching.md, "Admission never wedges"): the request's prompt-cache hit
is cut back to a step boundary or dropped when it would keep the row from
ever fitting the budget, and a request that cannot fit even bare gets its
400 (the engine core refuses such requests at once when the budget shrinks).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mlx_lm.models.cache import can_trim_prompt_cache

from mlxd.engine.chat.kv_caches import cut_prefix
from mlxd.engine.chat.prompt_cache import Fetched
from mlxd.engine.chat.row import Row
from mlxd.engine.policy import admission

if TYPE_CHECKING:
    from mlxd.engine.chat.core import EngineCore


def plan_cache(core: EngineCore, row: Row, fetched: Fetched) -> Fetched | None:
    """``row``'s lookup, its hit cut back or dropped when it would keep the row from ever
    fitting the budget; None when not even the bare request fits: the row is refused
    (a 400), and the caller takes it off its queue.

    Also sets ``row.extent`` to what admission projects: the prefix kept, and the
    positions where the prefill stops for checkpoints.
    """
    assert core.loaded is not None
    cached = len(row.prompt) - len(fetched.rest)
    cache = fetched.cache
    extent = _extent(core, row, cached)
    plan = admission.plan_hit(
        core.loaded.layout,
        extent,
        core.budget_bytes,
        core.settings.batch.prefill_step_size,
        trimmable=cache is not None and can_trim_prompt_cache(cache),
        cuts=lambda n: core.cuts(row, n),
    )
    if plan.refused is not None:
        core.refuse_over_budget(row, plan.refused)
        return None
    if plan.cached < cached:
        core.prompt_cache.not_used(fetched.source, cached - plan.cached, dropped=not plan.cached)
        cache, rest = cut_prefix(cache, row.prompt, fetched.rest, plan.cached)
        source = fetched.source if cache is not None else "none"
        fetched = replace(fetched, cache=cache, rest=rest, source=source)
        extent = _extent(core, row, plan.cached)
    row.extent = extent
    return fetched


def _extent(core: EngineCore, row: Row, cached: int) -> admission.RowExtent:
    return replace(row.extent, cached=cached, cuts=core.cuts(row, cached))
