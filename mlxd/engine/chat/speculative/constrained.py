"""Rows with logits processors in a verify step: grammars, penalties, logit_bias, budgets.

A row's processors see, at every drafted position, exactly what a plain step
would show them there: the row's tokens up to that position (its pending
token and the draft before it) and that position's logits. Penalties and
``logit_bias`` are pure functions of those two. The stateful ones (the
grammar, :class:`~mlxd.engine.chat.grammar.ConstraintProcessor`, and the
thinking budget, :class:`~mlxd.engine.chat.reasoning_budget.ReasoningBudget`)
advance one token per call as always; each is marked after every position,
and once the row's acceptance is known it is rewound to the mark after the
last accepted token (the grammar's matcher rolls back the rest), so it ends
in exactly the state it would have without speculation.

The grammar masks of every row's whole draft come from one parallel call to
llguidance's executor, made while the forward runs (:meth:`Walk._prefetch`).

Before the forward, a grammar row's draft is cut at the first token its
grammar forbids (``LLMatcher.validate_tokens``, which changes nothing) and
before any end-of-sequence token (a matcher that consumed one has stopped and
does not count it among the tokens it can roll back), so no position is
spent on a draft the row could never accept.

A grammar that fails (one of llguidance's limits: final, the matcher cannot
roll back) at a drafted position its row did not accept does not fail the
row; it restarts from a copy of its matcher taken before the step and replays
the accepted tokens (:meth:`Walk._recover`).

Not speculating (their rows run at depth 0 in the verify step): rows with a
test-only fault processor (it counts its calls), and rows the lane does not
know (no row to read the processor's state from).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLExecutor
from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens
from mlx_lm.generate import GenerationBatch

from mlxd.engine.chat.grammar import GrammarFailure


def may_speculate(batch: GenerationBatch, i: int, row: Any) -> bool:
    """Whether row ``i``'s processors (if any) can run along a draft and be rewound.

    ``row`` is the lane's :class:`~mlxd.engine.chat.row.Row` for it (None: unknown).
    """
    every = batch.logits_processors
    if not every or not every[i]:
        return True
    if row is None or row.request.fault:
        return False
    return row.matcher is None or hasattr(row.matcher, "rewind")


def cut(row: Any, eos: Collection[int], pending: int, draft: list[int]) -> list[int]:
    """``draft`` up to the first token the row's grammar forbids or an end of sequence."""
    matcher = row.matcher if row is not None else None
    if matcher is None or not draft:
        return draft
    for at, token in enumerate(draft):
        if token in eos:
            draft = draft[:at]
            break
    if not draft:
        return draft
    # The pending token is not consumed yet: the processor sees it at position 0.
    return draft[: max(0, matcher.allowed([pending, *draft]) - 1)]


class Walk:
    """One verify step's processors along each row's draft, and their rewind."""

    def __init__(
        self,
        batch: GenerationBatch,
        pending: list[int],
        drafts: list[list[int]],
        rows: list[Any] | None,
    ):
        self.batch = batch
        self.pending = pending
        self.drafts = drafts
        self.rows: list[Any] = rows or [None] * len(drafts)
        # Per row index: the stateful processor's mark after each position.
        self.marks: dict[int, list[Any]] = {}
        # Per grammar row: its grammar's mark and a copy of its matcher before the
        # step, and the position whose call failed the row (if one did).
        self.backups: dict[int, tuple[Any, Any]] = {}
        self.failed_at: dict[int, int] = {}

    def process(self, logits: mx.array) -> tuple[mx.array, list[mx.array]]:
        """``logits`` ``(rows, width, vocab)`` after each row's processors, position by position.

        Positions past a row's draft (padding) are left as they are; nothing reads them.
        Also returns the token contexts made (to evaluate with the step).
        """
        batch = self.batch
        every = batch.logits_processors or []
        if not any(every):
            return logits, []
        mx.async_eval(logits)  # the forward runs while the processors (CPU) do their part
        for e, draft in enumerate(self.drafts):
            row = self.rows[e]
            grammar = _grammar(row) if draft else None
            if grammar is not None and row.error is None:
                self.backups[e] = (grammar.mark(), grammar.matcher.deep_copy())
        ahead = self._prefetch()
        out: list[mx.array] = []
        contexts: list[mx.array] = []
        for e in range(len(batch.uids)):
            processors = every[e] or ()
            if not processors:
                out.append(logits[e])
                continue
            context = batch._token_context[e].update_and_fetch(mx.array([self.pending[e]]))
            contexts.append(context)
            out.append(self._row(e, processors, context, logits[e]))
        for grammar in ahead:
            grammar.prefetch([])
        return mx.stack(out), contexts

    def _prefetch(self) -> list[Any]:
        """Every active grammar's masks along its row's draft, in parallel, ahead of the walk.

        llguidance's executor advances each matcher along the pending token
        and the draft, writes the mask at each position and rolls back; the
        grammar processors then use these masks instead of computing them one
        call at a time. Returns the processors given masks.
        """
        jobs = []
        for e, draft in enumerate(self.drafts):
            grammar = _grammar(self.rows[e]) if e in self.backups else None
            if grammar is not None and grammar.active and grammar.words:
                jobs.append((e, grammar, [self.pending[e], *draft]))
        if not jobs:
            return []
        masks = np.full((sum(len(t) + 1 for _, _, t in jobs), jobs[0][1].words), -1, np.int32)
        at, where = 0, []
        for _, grammar, tokens in jobs:
            where.append((grammar.matcher, at, tokens))
            at += len(tokens) + 1
        fill_next_token_bitmask_par_with_draft_tokens(_executor(), where, masks)
        for (e, grammar, tokens), (matcher, start, _) in zip(jobs, where, strict=True):
            if matcher.is_error():  # a drafted position hit a limit: this row goes call by call
                grammar.matcher = self.backups[e][1].deep_copy()
                continue
            # ``start`` holds the mask before the pending token, which its last step used.
            grammar.prefetch([masks[start + 1 + j].tobytes() for j in range(len(tokens))])
        return [grammar for _, grammar, _ in jobs]

    def _row(
        self,
        e: int,
        processors: list[Callable[[mx.array, mx.array], mx.array]],
        context: mx.array,
        logits: mx.array,
    ) -> mx.array:
        draft = self.drafts[e]
        row: Any = self.rows[e]
        stateful = row.matcher if row is not None and draft else None
        marks: list[Any] = []
        positions: list[mx.array] = []
        for j in range(len(draft) + 1):
            tokens = context
            if j:
                tokens = mx.concatenate([context, mx.array(draft[:j], dtype=context.dtype)])
            x = logits[j : j + 1]
            for processor in processors:
                x = processor(tokens, x)
            positions.append(x)
            if e in self.backups and e not in self.failed_at and getattr(row, "error", None):
                self.failed_at[e] = j
            if stateful is not None:
                marks.append(stateful.mark())
        if stateful is not None:
            self.marks[e] = marks
        if len(draft) + 1 < logits.shape[0]:
            positions.append(logits[len(draft) + 1 :])
        return mx.concatenate(positions, axis=0)

    def settle(self, e: int, took: int) -> None:
        """Row ``e`` accepted ``took`` drafted tokens: its context and processors follow."""
        batch = self.batch
        every = batch.logits_processors or []
        if not every or not every[e]:
            return
        draft = self.drafts[e]
        if took:
            batch._token_context[e].update_and_fetch(mx.array(draft[:took]))
        marks = self.marks.get(e)
        row = self.rows[e]
        if took < self.failed_at.get(e, -1) and isinstance(row.error, GrammarFailure):
            self._recover(e, took)
            return
        if marks and took < len(draft) and row is not None and row.error is None:
            try:
                row.matcher.rewind(marks[took])
            except Exception as exc:  # the row fails alone, as its processor would
                row.error = exc

    def _recover(self, e: int, took: int) -> None:
        """Row ``e``'s grammar failed at a drafted position it did not accept: a plain
        step never computes that mask, so the row goes on. Its grammar restarts from
        the copy taken before the step and replays the accepted tokens."""
        row = self.rows[e]
        mark, matcher = self.backups[e]
        row.error = None
        try:
            _grammar(row).replay(mark, matcher, [self.pending[e], *self.drafts[e][:took]])
            if row.matcher is not _grammar(row):  # a thinking budget around it
                row.matcher.rewind(self.marks[e][took])
        except Exception as exc:  # the row fails alone, as its processor would
            row.error = exc


def _grammar(row: Any) -> Any:
    """The row's grammar processor (inside its thinking budget, if any), or None."""
    processor = row.matcher if row is not None else None
    processor = getattr(processor, "inner", processor)
    return processor if hasattr(processor, "prefetch") else None


_EXECUTOR: list[LLExecutor] = []


def _executor() -> LLExecutor:
    """llguidance's thread pool for parallel masks (one per process, made when first needed)."""
    if not _EXECUTOR:
        _EXECUTOR.append(LLExecutor())
    return _EXECUTOR[0]
