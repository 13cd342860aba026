"""One verify step over mlx-lm's ``GenerationBatch``: every row's draft in one forward.

mlx-lm's plain step feeds each row's pending token (sampled last step, not
yet in the cache) and samples the next. This step feeds each row's pending
token followed by its draft, right-padded to the widest row, and reads the
model's choice at every position: a greedy row keeps its draft up to the
first token the model would not have chosen, plus the model's own token
after it, which becomes its new pending token (a sampled row: rejection
sampling, :mod:`.rejection`). Rows without a draft (or not
allowed one) take position 0 exactly as the plain step does: their logits
processors and sampler, their own random state. A row's logits processors
run at each of its drafted positions (:mod:`.constrained`).

Each row then drops the positions it did not keep, in every layer cache
(:mod:`.rollback`: trim and the right-padding roll for attention, the
recorded per-position state for recurrent layers). Nothing is zeroed.

The step touches ``GenerationBatch``'s private state (``_next_tokens``,
``_num_tokens``, ``_matchers``, ...): mlx-lm has no hook for a multi-token
step (upstream gap, noted in docs/batching.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from mlxd.engine.chat.speculative.constrained import Walk
from mlxd.engine.chat.speculative.rejection import Rejection
from mlxd.engine.chat.speculative.rollback import begin, can_roll_back


@dataclass
class Verified:
    """What one verify step did, per row of the batch before it (uids)."""

    uids: list[int]
    drafted: list[int]
    accepted: list[int]
    width: int


def verifiable(batch: GenerationBatch) -> bool:
    """Whether every layer cache can keep a per-row prefix of a verify step."""
    return can_roll_back(batch.model, batch.prompt_cache)


def greedy_rows(batch: GenerationBatch) -> list[int]:
    """Rows on the shared greedy sampler, with or without logits processors
    (:mod:`.constrained` decides whether those rows may speculate)."""
    samplers = batch.samplers or [batch.fallback_sampler] * len(batch.uids)
    return [i for i in range(len(batch.uids)) if samplers[i] is batch.fallback_sampler]


def pending_tokens(batch: GenerationBatch) -> list[int]:
    """Each row's pending token (sampled, not yet in the cache), read back."""
    tokens = batch._next_tokens
    assert tokens is not None
    mx.eval(tokens)
    return cast("list[int]", tokens.tolist())


def survivors(batch: GenerationBatch, uids: list[int]) -> list[tuple[int, int, int]]:
    """After a verify step over rows ``uids``: ``(j, r, pending)`` for each row ``j`` of
    ``batch`` that was row ``r`` of the step, with its new pending token."""
    at = {uid: r for r, uid in enumerate(uids)}
    pending = pending_tokens(batch)
    return [(j, at[uid], pending[j]) for j, uid in enumerate(batch.uids) if uid in at]


def verify(
    batch: GenerationBatch,
    pending: list[int],
    drafts: list[list[int]],
    forward: Callable[..., mx.array] | None = None,
    lane_rows: list[Any] | None = None,
) -> tuple[list[GenerationBatch.Response], Verified]:
    """Feed every row's pending token and draft; keep what each row accepts.

    ``forward`` replaces ``batch.model`` for the forward (same logits; an MTP
    drafter's keeps the hidden states).

    Returns the responses mlx-lm's ``GenerationBatch.next`` would give, one
    per emitted token (several per row when drafts are accepted), and what
    was drafted and accepted per row. ``lane_rows`` (the lane's row per batch
    index) lets rows with logits processors keep a draft (:mod:`.constrained`).
    """
    n = len(batch.uids)
    uids = list(batch.uids)
    width = 1 + max(len(d) for d in drafts)
    rows = [[pending[i], *d, *([0] * (width - 1 - len(d)))] for i, d in enumerate(drafts)]
    model = forward if forward is not None else batch.model
    with begin(batch.model, batch.prompt_cache, width) as step:
        logits = model(mx.array(rows, dtype=mx.uint32), cache=batch.prompt_cache)

    walk = Walk(batch, pending, drafts, lane_rows)
    logits, context = walk.process(logits)
    first = logits[:, 0, :]
    first_lp = first - mx.logsumexp(first, axis=-1, keepdims=True)
    samplers = [batch.fallback_sampler if s is None else s for s in batch.samplers or [None] * n]
    if all(s is samplers[0] for s in samplers):  # one call, as the plain step makes it
        sampled = samplers[0](first_lp)
    else:
        sampled = mx.concatenate([s(first_lp[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
    later = logits[:, 1:, :]
    if width > 1:
        later_lp = later - mx.logsumexp(later, axis=-1, keepdims=True)
        choices = mx.argmax(later_lp, axis=-1)
    else:  # no row drafted (an MTP step that only keeps hidden states)
        later_lp, choices = later, mx.zeros((n, 0), dtype=mx.uint32)
    rejection = Rejection(batch, drafts, lane_rows)
    tests = rejection.prepare(first_lp, later_lp)
    mx.eval(sampled, first_lp, later_lp, choices, context, tests)
    sampled_list = cast("list[int]", sampled.tolist())
    choice_rows = cast("list[list[int]]", choices.tolist())

    previous_lp = batch._next_logprobs
    responses: list[GenerationBatch.Response] = []
    ending: list[tuple[int, GenerationBatch.Response]] = []
    keep: list[int] = []
    surplus: list[int] = []
    next_tokens: list[int] = []
    next_lp: list[mx.array] = []
    accepted: list[int] = []
    for i in range(n):
        draft = drafts[i]
        model_says = rejection.says(i) or [sampled_list[i], *choice_rows[i]]
        took = 0
        while took < len(draft) and draft[took] == model_says[took]:
            took += 1
        accepted.append(took)
        walk.settle(i, took)
        emitted = [pending[i], *draft[:took]]
        logprobs = [previous_lp[i]] + [
            first_lp[i] if j == 0 else later_lp[i, j - 1] for j in range(took)
        ]
        finish = None
        fed = 0
        for token, lp in zip(emitted, logprobs, strict=True):
            fed += 1
            batch._num_tokens[i] += 1
            if batch._num_tokens[i] >= batch.max_tokens[i]:
                finish = "length"
            if batch._matchers[i].advance(token):
                finish = "stop"
            response = GenerationBatch.Response(uids[i], token, lp, finish, None, None)
            responses.append(response)
            if finish is not None:
                ending.append((i, response))
                break
        batch.tokens[i].extend(emitted[:fed])
        surplus.append(width - fed)
        next_tokens.append(model_says[took])
        next_lp.append(first_lp[i] if took == 0 else later_lp[i, took - 1])
        if finish is None:
            keep.append(i)

    step.commit([width - s for s in surplus])
    for i, response in ending:
        response.prompt_cache = batch.extract_cache(i)
        response.all_tokens = batch.tokens[i]
    batch._current_tokens = None
    batch._current_logprobs = []
    batch._next_tokens = mx.array(next_tokens, dtype=sampled.dtype)
    batch._next_logprobs = next_lp
    if len(keep) < n:
        batch.filter(keep)
    return responses, Verified(uids, [len(d) for d in drafts], accepted, width)
