"""The serial lane: one request at a time through mlx-lm's ``generate_step``.

The engine advances a :class:`SerialRun` one token per loop iteration, so
cancels, snapshots and control calls still happen between tokens. The prompt
prefill runs inside the first advance; its progress callback lets the engine
keep its inbox and snapshot moving (and abort) during a long prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.chat.grammar import GrammarFailure
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.sampling import (
    build_processors,
    build_sampler,
    guard_processor,
    guard_sampler,
)

logger = logging.getLogger(__name__)

Ended = Literal["stop", "length", "cancelled", "failed"]


class _Abort(Exception):
    """Raised from the prefill callback when the row was cancelled."""


@dataclass(frozen=True)
class SerialStep:
    """What one advance of the serial row did.

    ``ended`` is None while the row goes on; else ``stop``, ``length``,
    ``cancelled`` or ``failed`` (with ``error``). ``engine_error`` marks a
    failure of generation itself rather than of the row's own processors.
    """

    seconds: float
    prefill: bool
    token: bool = False
    ended: Ended | None = None
    stopped_by_string: bool = False
    error: str | None = None
    engine_error: bool = False


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
        pump: Callable[[], None],
        faults: bool = False,
    ):
        self.row = row
        self._pump = pump
        self.cache = cache if cache is not None else make_prompt_cache(loaded.model)
        sampler = build_sampler(row.request, loaded.info.vocab_size)
        processors = build_processors(row.request, faults=faults, constraint=row.matcher)
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
            prompt_progress_callback=self._progress,
        )

    @property
    def nbytes(self) -> int:
        """Real bytes of this row's KV cache."""
        return sum(c.nbytes for c in self.cache)

    def _progress(self, done: int, total: int) -> None:
        self.row.prefill_done = done
        if done < total:
            self._pump()  # a long prefill must not freeze intake, cancels and /stats
        if self.row.cancelled:
            raise _Abort

    def step(self, eos_ids: Collection[int]) -> SerialStep:
        """Advance one token (the first call also prefills) and say what happened.

        The generator is closed once the row has ended, whatever the reason.
        """
        row = self.row
        started = time.perf_counter()
        prefill = row.first_token_mono is None
        try:
            if row.cancelled:
                raise _Abort
            out = next(self._steps, None)
        except _Abort:
            return self._end(started, prefill, "cancelled")
        except GrammarFailure as exc:  # the row's schema, not the engine (a 400)
            row.error = exc
            return self._end(started, prefill, "failed", error=str(exc))
        except Exception as exc:
            logger.exception("serial generation failed for %s", row.id)
            return self._end(
                started, prefill, "failed", error=f"generation failed: {exc}", engine_error=True
            )
        if out is None:
            return self._end(started, prefill, "length")
        # mlx-lm yields the token as an int (its annotation says array).
        token, logprobs = int(out[0]), out[1]
        is_eos = token in eos_ids
        stopped = False
        try:
            stopped = row.push_token(token, logprobs, is_eos=is_eos)
        except Exception as exc:  # the row's own detokenizer
            row.error = exc
        if row.error is not None:
            message = f"generation failed for this request: {row.error}"
            return self._end(started, prefill, "failed", token=True, error=message)
        if is_eos or stopped:
            return self._end(started, prefill, "stop", token=True, stopped_by_string=stopped)
        if row.generated >= row.max_tokens:
            return self._end(started, prefill, "length", token=True)
        return SerialStep(time.perf_counter() - started, prefill, token=True)

    def advance(self) -> int | None:
        """One raw generator step: the next token, or None when it is exhausted.

        A cluster follower steps its shard this way when rank 0 says so
        (:mod:`mlxd.engine.cluster.follower`); rank 0 decides when the row ends.
        """
        out = next(self._steps, None)
        return None if out is None else int(out[0])

    def _end(self, started: float, prefill: bool, ended: Ended, **kw: Any) -> SerialStep:
        self.close()
        return SerialStep(time.perf_counter() - started, prefill, ended=ended, **kw)

    def close(self) -> None:
        self._steps.close()
