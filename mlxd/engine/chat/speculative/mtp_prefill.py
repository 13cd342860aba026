"""MTP heads see the prompt: each prefill chunk's hidden states feed the rows' head caches.

Installed on an MTP lane's prompt batch (mlx-lm's ``PromptProcessingBatch``),
it runs each prefill chunk through the target's trunk and output head (the
same forward, :class:`~.mtp_head.MtpHead`), keeps the chunk's hidden states
and hands them to :meth:`~.mtp.MtpDrafter.prefilled`, which feeds the pairs
(hidden state at position ``p - 1``, token at ``p``) of the chunk to the
row's head cache and keeps the last hidden state for the first draft. The
rows moving on to generation do the same in their first step (mlx-lm runs
it, on the last prompt token, as it makes their generation batch; that one
step is evaluated at once instead of pipelined). So a row's head attends
over its prompt, as in training, and the row drafts on its first decode
step.

What it costs, in MTP lanes only (other lanes' prompt batches are not
touched): mlx-lm's prefill evaluates only the KV caches, so the last decoder
layer's output and the final norm are normally never computed; here they
are (one decoder layer of the target per prompt token), plus the head
layer's projections to its K/V (its MLP and output head stay unevaluated),
and the head's KV of the whole prompt (one layer's worth, not in the KV
budget).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from mlxd.engine.chat.speculative.mtp import MtpDrafter


def feed_prefill(prompts: Any, drafter: MtpDrafter, enabled: Callable[[], bool]) -> None:
    """Wrap ``prompts.prompt`` (a ``PromptProcessingBatch``) to feed ``drafter`` its chunks."""
    chunk = prompts.prompt
    head = drafter.head
    captured: list[mx.array] = []

    def forward(inputs: mx.array, cache: Any = None) -> mx.array:
        hidden = head.trunk(inputs, cache)
        # With the caches, as mlx-lm evaluates them next (then a no-op): one graph.
        mx.eval(hidden, [c.state for c in cache or ()])
        captured.append(hidden)
        return head.head(hidden)

    def prompt(tokens: list[list[int]]) -> None:
        if not enabled() or not tokens:
            chunk(tokens)
            return
        uids, before = list(prompts.uids), [len(t) for t in prompts.tokens]
        captured.clear()  # nothing left from a chunk that raised
        model, prompts.model = prompts.model, forward
        try:
            chunk(tokens)
        finally:
            prompts.model = model
        if not captured:  # no forward ran (every chunk empty)
            return
        hidden = captured[0] if len(captured) == 1 else mx.concatenate(captured, axis=1)
        captured.clear()
        drafter.prefilled(uids, before, tokens, hidden)

    split = prompts.split

    def moving(indices: list[int]) -> Any:
        """The rows moving to generation: their first step (mlx-lm runs it as the
        generation batch is made, feeding each row's last prompt token) feeds too."""
        rows = split(indices)
        if not enabled():
            return rows
        uids, before, model = list(rows.uids), [len(t) for t in rows.tokens], rows.model

        def first(inputs: mx.array, cache: Any = None) -> mx.array:
            if inputs.shape[1] != 1:
                return model(inputs, cache=cache)
            hidden = head.trunk(inputs, cache)
            drafter.prefilled(uids, before, cast("list[list[int]]", inputs.tolist()), hidden)
            return head.head(hidden)

        rows.model = first
        return rows

    prompts.prompt = prompt
    prompts.split = moving
