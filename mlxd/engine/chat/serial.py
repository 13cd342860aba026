"""The serial lane: one request at a time through mlx-lm's ``generate_step``.

The engine advances a :class:`SerialRun` one token per loop iteration, so
cancels, snapshots and control calls still happen between tokens. The prompt
prefill runs inside the first advance; its progress callback lets the engine
keep its inbox and snapshot moving (and abort) during a long prompt. A prompt
with checkpoints (``row.checkpoints``) is prefilled a segment at a time, the
cache copied at each cut (:mod:`.checkpoints`), and only its last segment
goes to ``generate_step``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream

from mlxd.engine.chat.checkpoints import segments
from mlxd.engine.chat.grammar import GrammarFailure
from mlxd.engine.chat.kv_caches import normalize
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.quant_cache import fresh_cache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.sampling import (
    build_processors,
    build_sampler,
    guard_processor,
    guard_sampler,
)
from mlxd.engine.chat.vision import guard_tokens, hold, let_go

logger = logging.getLogger(__name__)

# Called with a checkpoint's tokens, a copy of the cache there, and its kind.
OnCheckpoint = Callable[[list[int], list[Any], Any], None]

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
        on_checkpoint: OnCheckpoint | None = None,
    ):
        self.row = row
        self._pump = pump
        self._model = loaded.model
        self._step_size = prefill_step_size
        self._on_checkpoint = on_checkpoint
        self.cache = cache if cache is not None else fresh_cache(loaded.model, loaded.kv_quant)
        sampler = build_sampler(row.request, loaded.info.vocab_size)
        processors = build_processors(row.request, faults=faults, constraint=row.matcher)
        if row.images is not None:
            processors = [guard_tokens(p, row.images.placeholder) for p in processors]
        if row.request.sampling.seed is not None:
            # The serial lane runs alone, so the global generator is this row's.
            mx.random.seed(row.request.sampling.seed)
        start = len(row.prompt) - len(rest)
        marks = list(row.checkpoints) if on_checkpoint is not None else []
        parts = segments(rest, start, [p for p, _ in marks])
        last = parts[-1]
        # generate_step shows its processors only the tokens it is given: give
        # them the whole prompt, as the batch lane does.
        guarded = [guard_processor(row, p) for p in processors]
        before = row.prompt[: len(row.prompt) - len(last)]
        if guarded and before:
            guarded = [_with_history(before, p) for p in guarded]
        self._done = 0
        self._total = len(rest)
        # Prompt tokens the cache holds (prefilled so far, with the cached prefix).
        self.held = self._start = start
        self._steps = self._generate(parts[:-1], marks, start)
        self._tail = generate_step(
            mx.array(last),
            loaded.model,
            max_tokens=row.tokens_left,
            sampler=guard_sampler(row, sampler) if sampler else None,
            logits_processors=guarded or None,
            prompt_cache=self.cache,
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=self._tail_progress,
        )
        hold(self._model, row, rest)  # the vision tower, for images still to prefill (last)

    def _generate(
        self, parts: list[list[int]], marks: list[tuple[int, Any]], start: int
    ) -> Generator[tuple[Any, Any], None, None]:
        at = start
        for part, (position, kind) in zip(parts, marks, strict=True):
            self._prefill(part)
            at += len(part)
            assert at == position
            assert self._on_checkpoint is not None
            # Copies share the arrays (MLX arrays are values); the run's own cache goes on.
            self._on_checkpoint(self.row.prompt[:position], copy.deepcopy(self.cache), kind)
        yield from self._tail

    def _prefill(self, tokens: list[int]) -> None:
        """Prefill a segment in ``prefill_step_size`` chunks, as generate_step does."""
        with mx.stream(generation_stream):
            while tokens:
                chunk, tokens = tokens[: self._step_size], tokens[self._step_size :]
                self._model(mx.array(chunk)[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                self._done += len(chunk)
                self._progress(self._done, self._total)
                mx.clear_cache()

    def _tail_progress(self, done: int, total: int) -> None:
        self._progress(self._done + done, self._total)

    @property
    def nbytes(self) -> int:
        """Real bytes of this row's KV cache."""
        return sum(c.nbytes for c in self.cache)

    def _progress(self, done: int, total: int) -> None:
        self.row.prefill_done = done
        self.held = self._start + done
        if done < total:
            normalize(self.cache)  # the next chunk grows from the position (see kv_caches)
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
        let_go(self._model, row)  # the prefill is over
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
        let_go(self._model, self.row)
        self._steps.close()
        self._tail.close()


def _with_history(before: list[int], processor: Any) -> Any:
    history = mx.array(before)

    def processor_with_history(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(mx.concatenate([history, tokens]), logits)

    return processor_with_history
