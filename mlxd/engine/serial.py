"""The serial lane: one request at a time through mlx-lm's ``generate_step``.

The engine advances a :class:`SerialRun` one token per loop iteration, so
cancels, snapshots and control calls still happen between tokens. The prompt
prefill runs inside the first advance; its progress callback lets the engine
keep its inbox and snapshot moving (and abort) during a long prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.model import LoadedModel
from mlxd.engine.row import Row
from mlxd.engine.sampling import build_processors, build_sampler, guard_processor, guard_sampler


class SerialRun:
    """One serial row's generator and its cache."""

    def __init__(
        self,
        loaded: LoadedModel,
        row: Row,
        cache: list[Any] | None,
        rest: list[int],
        *,
        prefill_step_size: int,
        on_progress: Callable[[int, int], None],
        faults: bool = False,
    ):
        self.row = row
        self.cache = cache if cache is not None else make_prompt_cache(loaded.model)
        sampler = build_sampler(row.request)
        processors = build_processors(row.request, faults=faults)
        if row.request.sampling.seed is not None:
            # The serial lane runs alone, so the global generator is this row's.
            mx.random.seed(row.request.sampling.seed)
        self._steps = generate_step(
            mx.array(rest),
            loaded.model,
            max_tokens=row.max_tokens,
            sampler=guard_sampler(row, sampler) if sampler else None,
            logits_processors=[guard_processor(row, p) for p in processors] or None,
            prompt_cache=self.cache,
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=on_progress,
        )

    def advance(self) -> tuple[int, mx.array] | None:
        """The next token and its log-probabilities, or None when max_tokens is reached."""
        return next(self._steps, None)

    def close(self) -> None:
        self._steps.close()
