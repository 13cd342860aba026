"""The thinking budget processor alone: counting, a multi-token end marker, the grammar after."""

from __future__ import annotations

import mlx.core as mx

from mlxd.engine.chat.reasoning_budget import ReasoningBudget

WIDTH = 16


def run(processor: ReasoningBudget, prompt: list[int], picks: list[int]) -> list[int]:
    """Feed the processor like mlx-lm: each step's argmax becomes the next token,
    unless ``picks`` (the model's own choice) is allowed."""
    tokens = list(prompt)
    out = []
    for pick in picks:
        logits = mx.zeros((1, WIDTH))
        masked = processor(mx.array(tokens), logits)
        allowed = [i for i in range(WIDTH) if masked[0, i].item() != -float("inf")]
        token = pick if pick in allowed else allowed[0]
        tokens.append(token)
        out.append(token)
    return out


def test_the_end_marker_is_forced_after_the_budget():
    budget = ReasoningBudget(3, think_start=(1,), think_end=(5, 6), reasoning=True)
    assert run(budget, [0, 1], [9, 9, 9, 9, 9, 9, 4]) == [9, 9, 9, 5, 6, 9, 4]
    assert budget.state == "done" and budget.spent == 3


def test_thinking_that_ends_in_time_is_left_alone_and_a_start_is_waited_for():
    budget = ReasoningBudget(4, think_start=(1,), think_end=(5,), reasoning=False)
    assert run(budget, [0], [7, 1, 9, 5, 9, 9, 9, 9]) == [7, 1, 9, 5, 9, 9, 9, 9]
    assert budget.state == "done"
    late = ReasoningBudget(2, think_start=(1,), think_end=(5,), reasoning=False)
    assert run(late, [0], [7, 7, 1, 9, 9, 9, 9]) == [7, 7, 1, 9, 9, 5, 9]


def test_the_inner_grammar_sees_every_call_and_applies_after():
    seen = []

    def grammar(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(int(tokens.shape[-1]))
        return logits

    budget = ReasoningBudget(1, think_start=(1,), think_end=(5,), reasoning=True, inner=grammar)
    run(budget, [0, 1], [9, 9, 9])
    assert seen == [2, 3, 4]
    assert not ReasoningBudget(1, think_start=(), think_end=(5,), reasoning=True).active
