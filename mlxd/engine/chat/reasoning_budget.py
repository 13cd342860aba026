"""A thinking budget: a row's reasoning ends after so many tokens.

Thinking models spend ``max_tokens`` on reasoning unless something stops
them. A request with a budget (``reasoning_effort``, ``reasoning.effort``,
Anthropic's ``thinking.budget_tokens``) gets this processor in its logits
slot, in front of its grammar if it has one: it watches the row's tokens for
the model's think markers, counts the tokens generated inside them, and when
the count reaches the budget forces the end marker (``</think>``, or the
model's multi-token end), one token per step. The answer follows, within
``max_tokens``; a grammar starts after the end marker as it always does
(its own processor watches for the marker too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx


class ReasoningBudget:
    """A row's budget as an mlx-lm logits processor ``(tokens, logits) -> logits``.

    ``inner`` (the row's grammar processor, or None) always sees every call,
    so its own view of the tokens stays whole; the forcing is applied on top.
    """

    def __init__(
        self,
        budget: int,
        *,
        think_start: Sequence[int],
        think_end: Sequence[int],
        reasoning: bool,
        inner: Any = None,
    ):
        self.budget = budget
        self.inner = inner
        self._start = tuple(think_start)
        self._end = tuple(think_end)
        # "before" (no think block yet), "reasoning", "forcing", "done"
        self.state = "reasoning" if reasoning else "before"
        self.spent = 0
        self._tail: list[int] = []
        self._forced: list[int] = []
        self._base: int | None = None
        self._seen = 0

    @property
    def active(self) -> bool:
        """False while the row is inside its think block (what a grammar processor says)."""
        return self.state not in ("reasoning", "forcing")

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._base is None:
            self._base = int(tokens.shape[-1])
        else:
            new = cast(list[int], tokens[self._base + self._seen :].tolist())
            self._seen += len(new)
            for token in new:
                self._consume(token)
        if self.inner is not None:
            logits = self.inner(tokens, logits)
        if self.state == "reasoning" and self.spent >= self.budget:
            self.state = "forcing"
            self._forced = list(self._end)
        if self.state == "forcing" and self._forced:
            return _only(logits, self._forced[0])
        return logits

    # Speculative decoding: the same three calls as the grammar processor's.

    def allowed(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the inner grammar allows (all of them without one)."""
        return self.inner.allowed(tokens) if self.inner is not None else len(tokens)

    def mark(self) -> tuple[Any, ...]:
        inner = self.inner.mark() if self.inner is not None else None
        state = (self.state, self.spent, tuple(self._tail), tuple(self._forced), self._seen)
        return (*state, inner)

    def rewind(self, mark: tuple[Any, ...]) -> None:
        self.state, self.spent, tail, forced, self._seen, inner = mark
        self._tail, self._forced = list(tail), list(forced)
        if self.inner is not None:
            self.inner.rewind(inner)

    def _consume(self, token: int) -> None:
        if self.state == "done":
            return
        if self.state == "forcing":
            if self._forced and token == self._forced[0]:
                self._forced.pop(0)
            if not self._forced:
                self.state = "done"
            return
        self._tail = [*self._tail, token][-max(len(self._start), len(self._end)) :]
        if self.state == "before":
            if _ends_with(self._tail, self._start):
                self.state, self._tail = "reasoning", []
            return
        self.spent += 1
        if _ends_with(self._tail, self._end):
            self.state = "done"


def _ends_with(tail: list[int], marker: tuple[int, ...]) -> bool:
    return bool(marker) and tuple(tail[-len(marker) :]) == marker


def _only(logits: mx.array, token: int) -> mx.array:
    """Every logit but ``token``'s set to -inf (``logits`` is ``(1, width)``)."""
    keep = mx.arange(logits.shape[-1]) == token
    return mx.where(keep, logits, mx.array(-float("inf"), dtype=logits.dtype))


def make_budget(tokenizer: Any, budget: int | None, phase: str, inner: Any) -> Any:
    """``inner`` wrapped in the row's budget, or ``inner`` itself when there is none
    (no budget asked, or a model without think markers)."""
    if budget is None or not getattr(tokenizer, "has_thinking", False):
        return inner
    end = tuple(tokenizer.think_end_tokens or ())
    if not end:
        return inner
    return ReasoningBudget(
        budget,
        think_start=tuple(tokenizer.think_start_tokens or ()),
        think_end=end,
        reasoning=phase == "reasoning",
        inner=inner,
    )
