"""Sampled rows in a verify step: speculative rejection sampling against a point-mass draft.

Both proposers are deterministic (prompt lookup copies tokens, a draft model
drafts greedily), so the draft distribution ``q`` at each position is a point
mass on the drafted token ``x``. The standard rule (accept with probability
``min(1, p(x) / q(x))``, else sample from ``max(0, p - q)`` renormalized)
becomes: accept ``x`` with probability ``p(x)``; on rejection, sample from
``p`` with ``x`` removed and renormalized; after a fully accepted draft,
sample the next token from ``p``. Each emitted token is then distributed
exactly as the row's own sampler would draw it.

``p`` is the row's sampling distribution at that position as its sampler
builds it (mlx-lm's ``make_sampler``): the processed logprobs, then top-p,
min-p and top-k in that order, then the temperature. The draws use MLX's
global random state, as the row's sampler does in the batch (seeded requests
run in the serial lane, which does not speculate).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlxd.engine.messages import SamplingParams


def samples(row: Any) -> bool:
    """Whether ``row`` (the lane's Row, or None) samples (temperature > 0)."""
    return row is not None and row.request.sampling.temperature > 0


def sampling_logits(logprobs: mx.array, s: SamplingParams) -> mx.array:
    """``logprobs`` ``(..., vocab)`` filtered and scaled as the row's sampler does.

    A categorical draw over the result is the sampler's draw.
    """
    vocab = logprobs.shape[-1]
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < s.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, s.top_p))
    if s.min_p != 0.0:
        filters.append(lambda x: cast(mx.array, apply_min_p(x, s.min_p, 1)))
    if 0 < s.top_k < vocab:
        filters.append(lambda x: apply_top_k(x, s.top_k))
    for f in filters:
        logprobs = f(logprobs)
    return logprobs * (1.0 / s.temperature)


def accept(logits: mx.array, draft: list[int]) -> tuple[mx.array, mx.array]:
    """Rejection sampling of ``draft`` (k tokens) against ``logits`` ``(k + 1, vocab)``.

    Returns ``ok`` ``(k,)``: whether each drafted token passed its test, and
    ``candidates`` ``(k + 1,)``: at each position before the last, the token
    drawn from ``p`` without that drafted token; at the last, a draw from ``p``.
    The row keeps its draft up to the first failed test and emits that
    position's candidate (the last one when every test passed).
    """
    k = len(draft)
    d = mx.array(draft, dtype=mx.int32)[:, None]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p_draft = mx.exp(mx.take_along_axis(logp[:k], d, axis=-1))[:, 0]
    ok = mx.random.uniform(shape=(k,)) < p_draft
    without = mx.put_along_axis(logits[:k], d, mx.array(-float("inf"), logits.dtype), axis=-1)
    candidates = mx.random.categorical(mx.concatenate([without, logits[k:]], axis=0))
    return ok, candidates


class Rejection:
    """A verify step's sampled rows with a draft: their tests and candidates."""

    def __init__(self, batch: GenerationBatch, drafts: list[list[int]], rows: list[Any] | None):
        fallback = batch.fallback_sampler
        samplers = batch.samplers or [fallback] * len(drafts)
        lane: list[Any] = rows or [None] * len(drafts)
        self.drafts = drafts
        self.sampled = [
            i
            for i, d in enumerate(drafts)
            if d and samplers[i] is not fallback and samples(lane[i])
        ]
        self._params = {i: lane[i].request.sampling for i in self.sampled}
        self._out: dict[int, tuple[mx.array, mx.array]] = {}
        self._says: dict[int, list[int]] = {}

    def prepare(self, first_lp: mx.array, later_lp: mx.array) -> list[mx.array]:
        """Build each sampled row's tests from its logprobs; returns the arrays to evaluate."""
        out: list[mx.array] = []
        for i in self.sampled:
            k = len(self.drafts[i])
            lp = mx.concatenate([first_lp[i : i + 1], later_lp[i, :k]], axis=0)
            self._out[i] = accept(sampling_logits(lp, self._params[i]), self.drafts[i])
            out.extend(self._out[i])
        return out

    def says(self, i: int) -> list[int] | None:
        """Row ``i``'s tokens per position as the acceptance loop reads them (None: greedy).

        A drafted token that passed its test stands for itself; the first that
        failed is replaced by its candidate (never the drafted token), so the
        loop keeps the draft up to there and emits the candidate.
        """
        if i not in self._out:
            return None
        ok, candidates = self._out[i]
        passed = cast("list[bool]", ok.tolist())
        drawn = cast("list[int]", candidates.tolist())
        draft = self.drafts[i]
        return [draft[j] if passed[j] else drawn[j] for j in range(len(draft))] + [drawn[-1]]
