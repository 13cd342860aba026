"""Per-row samplers and logits processors, from mlx-lm, guarded per row.

A processor or sampler that raises must fail its own row only. mlx-lm calls
them inside the batched step, so each one is wrapped: an exception is stored
on the row (the engine removes it after the step) and the step goes on with
the logits untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlxd.engine.messages import GenerationRequest

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection (docs/testing.md)."""


def build_sampler(request: GenerationRequest, vocab_size: int) -> Sampler | None:
    """The row's sampler, or None for greedy (the batch's shared argmax).

    A ``top_k`` that keeps the whole vocabulary filters nothing, so it is
    dropped (mlx-lm's top-k only takes values below the logits' width).
    """
    s = request.sampling
    if s.temperature == 0:
        return None
    top_k = s.top_k if s.top_k < vocab_size else 0
    return make_sampler(s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=top_k)


def build_processors(
    request: GenerationRequest, *, faults: bool, constraint: Processor | None = None
) -> list[Processor]:
    """The row's processors: penalties and logit_bias, then its grammar mask (last,
    so nothing can re-allow a token the grammar forbids)."""
    p = request.penalties
    processors = make_logits_processors(
        dict(p.logit_bias) or None,
        p.repetition_penalty if p.repetition_penalty not in (None, 1.0) else None,
        20,
        p.presence_penalty or None,
        20,
        p.frequency_penalty or None,
        20,
    )
    if constraint is not None:
        processors.append(constraint)
    if faults and request.fault and request.fault != "never_admit":  # that one is admission's
        processors.append(_faulty_processor(request.fault))
    return processors


def _faulty_processor(spec: str) -> Processor:
    """A processor that misbehaves from its Nth call (``"kind@N"``, default 1).

    ``logits_processor`` raises (the row must fail alone); ``bad_logits``
    returns logits of the wrong shape, which breaks the batched step itself
    (every row of that batch fails and the engine rebuilds the batch).
    """
    kind, _, at_text = spec.partition("@")
    if kind not in ("logits_processor", "bad_logits"):
        raise ValueError(f"unknown fault {spec!r}")
    at = int(at_text or 1)
    calls = 0

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        calls += 1
        if calls < at:
            return logits
        if kind == "bad_logits":
            return logits[:, :-1]
        raise InjectedFault(f"injected logits processor failure at token {calls}")

    return processor


def guard_sampler(row: Any, sampler: Sampler) -> Sampler:
    def guarded(logprobs: mx.array) -> mx.array:
        if row.error is None:
            try:
                return sampler(logprobs)
            except Exception as exc:
                row.error = exc
        return mx.argmax(logprobs, axis=-1)

    return guarded


def guard_processor(row: Any, processor: Processor) -> Processor:
    def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
        if row.error is None:
            try:
                return processor(tokens, logits)
            except Exception as exc:
                row.error = exc
        return logits

    return guarded
