"""One verify step over mlx-lm's ``GenerationBatch``: every row's draft in one forward.

mlx-lm's plain step feeds each row's pending token (sampled last step, not
yet in the cache) and samples the next. This step feeds each row's pending
token followed by its draft, right-padded to the widest row, and reads the
model's choice at every position: a greedy row keeps its draft up to the
first token the model would not have chosen, plus the model's own token
after it, which becomes its new pending token. Rows without a draft (or not
allowed one) take position 0 exactly as the plain step does: their logits
processors and sampler, their own random state.

Each row then drops the positions it did not keep: all rows the common
part by ``trim``; the rest per row by the right-padding roll that
``BatchKVCache`` already has (``prepare(right_padding)`` + ``finalize()``),
which moves the row's kept positions to the end and its dropped ones into
its left padding, which attention masks. Nothing is zeroed.

The step touches ``GenerationBatch``'s private state (``_next_tokens``,
``_num_tokens``, ``_matchers``, ...): mlx-lm has no hook for a multi-token
step (upstream gap, noted in docs/batching.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache


@dataclass
class Verified:
    """What one verify step did, per row of the batch before it (uids)."""

    uids: list[int]
    drafted: list[int]
    accepted: list[int]
    width: int


def verifiable(batch: GenerationBatch) -> bool:
    """Whether every layer cache can drop per-row positions (plain full-attention KV)."""
    return bool(batch.prompt_cache) and all(type(c) is BatchKVCache for c in batch.prompt_cache)


def greedy_rows(batch: GenerationBatch) -> list[int]:
    """Rows that may speculate: the shared greedy sampler and no logits processor."""
    processors = batch.logits_processors or [()] * len(batch.uids)
    samplers = batch.samplers or [batch.fallback_sampler] * len(batch.uids)
    return [
        i
        for i in range(len(batch.uids))
        if not processors[i] and samplers[i] is batch.fallback_sampler
    ]


def pending_tokens(batch: GenerationBatch) -> list[int]:
    """Each row's pending token (sampled, not yet in the cache), read back."""
    tokens = batch._next_tokens
    assert tokens is not None
    mx.eval(tokens)
    return cast("list[int]", tokens.tolist())


def rollback(caches: list[Any], surplus: list[int]) -> None:
    """Drop the last ``surplus[i]`` positions of row ``i`` from every layer cache."""
    common = min(surplus)
    extra = [s - common for s in surplus]
    for cache in caches:
        if common:
            cache.trim(common)
        if any(extra):
            cache.prepare(right_padding=extra)
            cache.finalize()


def verify(
    batch: GenerationBatch, pending: list[int], drafts: list[list[int]]
) -> tuple[list[GenerationBatch.Response], Verified]:
    """Feed every row's pending token and draft; keep what each row accepts.

    Returns the responses mlx-lm's ``GenerationBatch.next`` would give, one
    per emitted token (several per row when drafts are accepted), and what
    was drafted and accepted per row.
    """
    n = len(batch.uids)
    uids = list(batch.uids)
    width = 1 + max(len(d) for d in drafts)
    rows = [[pending[i], *d, *([0] * (width - 1 - len(d)))] for i, d in enumerate(drafts)]
    logits = batch.model(mx.array(rows, dtype=mx.uint32), cache=batch.prompt_cache)

    first, context = _processed(batch, logits[:, 0, :], pending)
    first_lp = first - mx.logsumexp(first, axis=-1, keepdims=True)
    samplers = [batch.fallback_sampler if s is None else s for s in batch.samplers or [None] * n]
    if all(s is samplers[0] for s in samplers):  # one call, as the plain step makes it
        sampled = samplers[0](first_lp)
    else:
        sampled = mx.concatenate([s(first_lp[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
    later = logits[:, 1:, :]
    later_lp = later - mx.logsumexp(later, axis=-1, keepdims=True)
    choices = mx.argmax(later_lp, axis=-1)
    mx.eval(sampled, first_lp, later_lp, choices, context)
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
        model_says = [sampled_list[i], *choice_rows[i]]
        took = 0
        while took < len(draft) and draft[took] == model_says[took]:
            took += 1
        accepted.append(took)
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

    rollback(batch.prompt_cache, surplus)
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


def _processed(
    batch: GenerationBatch, logits: mx.array, pending: list[int]
) -> tuple[mx.array, list[mx.array]]:
    """Position 0's logits after each row's processors, as the plain step applies them."""
    every = batch.logits_processors or []
    if not any(every):
        return logits, []
    out = []
    context = []
    for e in range(len(batch.uids)):
        row = logits[e : e + 1]
        processors = every[e] or ()
        if processors:
            tokens = batch._token_context[e].update_and_fetch(mx.array([pending[e]]))
            context.append(tokens)
            for processor in processors:
                row = processor(tokens, row)
        out.append(row)
    return mx.concatenate(out, axis=0), context
