"""Rows with logits processors speculate and give the output they give without speculation.

A JSON-schema row, a forced tool-call row, a row with penalties and
``logit_bias``, and logprobs rows, solo and four at once, draft from the
oracle of tests/engine/test_speculative.py (the answer with speculation off,
one token of every third draft corrupted: often a token the grammar forbids,
which cuts the draft, sometimes one it allows, which the rewind undoes).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.chat.grammar import (
    ConstraintProcessor,
    GrammarFailure,
    Grammars,
    make_ll_tokenizer,
)
from mlxd.engine.chat.reasoning_budget import ReasoningBudget
from mlxd.engine.chat.sampling import guard_processor
from mlxd.engine.chat.speculative.constrained import Walk
from mlxd.engine.chat.speculative.speculator import Speculator
from mlxd.engine.constraints import json_constraint, tool_constraint
from mlxd.engine.messages import (
    ChatPrompt,
    Finished,
    GenerationRequest,
    PenaltyParams,
    SamplingParams,
)
from mlxd.engine.policy.spec_depth import StepCosts
from tests.engine.test_speculative import MAX_TOKENS, TEXTS, WIDE, oracle, run_waves
from tests.support.engine import token_request
from tests.support.tinymodels import tiny_model_dir

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"name": "get", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


@pytest.fixture(autouse=True)
def formula_costs(monkeypatch):
    """The cost model's formula only: step times measured on a shared CPU would vary."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, rows, width: None)


def kinds(tokenizer, tag: str):
    """A JSON-schema row with logprobs, a tool-call row, a plain logprobs row, a penalised row."""
    tools = tool_constraint(
        [{**TOOL, "strict": False}], tool_format="json_tools", parallel=False, param="p"
    )
    extra = [
        {"constraint": json_constraint(SCHEMA, strict=True, param="p"), "logprobs": True},
        {"constraint": tools},
        {"logprobs": True, "top_logprobs": 3},
        {
            "penalties": PenaltyParams(
                repetition_penalty=2.0,
                presence_penalty=2.0,
                frequency_penalty=2.0,
                logit_bias=((30, 3.0), (31, -2.0)),
            )
        },
    ]
    return [
        token_request(f"{tag}{i}", tokenizer.encode(t), MAX_TOKENS, **kw)
        for i, (t, kw) in enumerate(zip(TEXTS, extra, strict=True))
    ]


def test_grammar_penalty_and_logprobs_rows_speculate_with_output_unchanged(
    tiny_loaded, monkeypatch
):
    model_dir = tiny_model_dir("llama", template="hermes")  # a tool-call format
    _, tokenizer = tiny_loaded("llama")
    four = kinds(tokenizer, "k")
    # Each kind alone (its own wave), then all four at once.
    waves = [[r] for r in kinds(tokenizer, "s")] + [four]
    (off, *_), _ = run_waves(model_dir, [four], "off")
    oracle(
        monkeypatch, {tuple(tokenizer.encode(t)): o.tokens for t, o in zip(TEXTS, off, strict=True)}
    )
    outs, counters = run_waves(model_dir, waves, "prompt_lookup", **WIDE)
    for kind, (solo,) in enumerate(outs[:4]):
        assert solo.tokens == off[kind].tokens, kind
    assert [o.tokens for o in outs[4]] == [o.tokens for o in off]
    accepted = [0] + [c["spec_accepted_tokens"] for c in counters]
    assert all(b > a for a, b in itertools.pairwise(accepted)), accepted  # every wave speculated
    assert counters[-1]["spec_accepted_tokens"] < counters[-1]["spec_drafted_tokens"]
    assert off[0].text.startswith('{"a":') and "<tool_call>" in off[1].text
    for got in (outs[0][0], outs[4][0], outs[2][0], outs[4][2]):
        want = off[0] if got.tokens == off[0].tokens else off[2]
        lp_off = [lp for d in want.deltas for lp in d.logprobs]
        lp_on = [lp for d in got.deltas for lp in d.logprobs]
        assert len(lp_on) == len(lp_off) == len(want.tokens)
        for a, b in zip(lp_off, lp_on, strict=True):
            assert a.id == b.id and abs(a.logprob - b.logprob) < 1e-3
            assert [t.id for t in a.top] == [t.id for t in b.top]
            assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(a.top, b.top, strict=True))


def test_real_prompt_lookup_drafts_a_tool_call_the_prompt_holds_and_output_is_unchanged():
    """No oracle: the prompt holds the call the row will make, prompt lookup finds it."""
    model_dir = tiny_model_dir("llama", template="hermes")
    tokenizer = load_tokenizer(model_dir)
    tools = tool_constraint(
        [{**TOOL, "strict": False}], tool_format="json_tools", parallel=False, param="p"
    )
    (first,), _ = run_waves(
        model_dir, [[token_request("t", tokenizer.encode("Copy:"), 40, constraint=tools)]], "off"
    )
    call = first[0].text
    copy = tokenizer.encode(f"Copy: {call}\n{call}")

    def waves(tag: str):
        json_row = json_constraint(SCHEMA, strict=True, param="p")
        four = [
            token_request(f"{tag}0", copy, 40, constraint=tools),
            token_request(f"{tag}1", tokenizer.encode(TEXTS[1]), MAX_TOKENS, constraint=json_row),
            token_request(f"{tag}2", tokenizer.encode(TEXTS[2]), MAX_TOKENS, logprobs=True),
            token_request(
                f"{tag}3", copy, MAX_TOKENS, penalties=PenaltyParams(repetition_penalty=1.3)
            ),
        ]
        return [[token_request(f"{tag}s", copy, 40, constraint=tools)], four]

    off, _ = run_waves(model_dir, waves("off"), "off")
    on, counters = run_waves(model_dir, waves("on"), "prompt_lookup", **WIDE)
    assert "<tool_call>" in call
    assert [[o.tokens for o in wave] for wave in on] == [[o.tokens for o in wave] for wave in off]
    solo, four = (c["spec_accepted_tokens"] for c in counters)
    assert 0 < solo < four, (solo, four)


def test_a_grammar_row_that_thinks_first_speculates_across_its_think_end(monkeypatch):
    """A thinking budget forces ``</think>``, then the grammar starts: drafts cross both."""
    model_dir = tiny_model_dir("llama", template="hermes_think")

    def request(rid: str) -> GenerationRequest:
        return GenerationRequest(
            id=rid,
            prompt=ChatPrompt(({"role": "user", "content": TEXTS[0]},)),
            max_tokens=MAX_TOKENS,
            sampling=SamplingParams(),
            constraint=json_constraint(SCHEMA, strict=True, param="p"),
            reasoning_budget=8,
        )

    (off,), _ = run_waves(model_dir, [[request("off")]], "off")
    think_end = load_tokenizer(model_dir).convert_tokens_to_ids("</think>")
    at_end = off[0].tokens.index(think_end)
    crossed = [0]

    def draft(self, uid, tokens, pending, k):
        """The answer; a draft that crosses ``</think>`` has the thought token before it wrong
        (rejected there, after the grammar already consumed the answer's first tokens)."""
        done = len(tokens) - len(self.rows[uid].prompt) + 1
        out = list(off[0].tokens[done : done + k])
        if done <= at_end - 1 and at_end + 1 < done + len(out):
            crossed[0] += 1
            out[at_end - 1 - done] = (out[at_end - 1 - done] + 1) % 500
        return out

    monkeypatch.setattr(Speculator, "_draft", draft)
    (on,), (counters,) = run_waves(model_dir, [[request("on")]], "prompt_lookup", **WIDE)
    end = off[0].end
    assert isinstance(end, Finished) and end.usage.reasoning_tokens >= 8
    assert off[0].text.startswith('{"a":')  # the answer after the forced end is the grammar's
    assert on[0].tokens == off[0].tokens and on[0].text == off[0].text
    assert counters["spec_accepted_tokens"] > 0 and crossed[0] > 0


def grammar(tiny_loaded) -> tuple[Grammars, Any]:
    _, tokenizer = tiny_loaded("llama")
    return Grammars(make_ll_tokenizer(tokenizer, 512), 512), tokenizer


def test_a_grammar_processor_checks_a_draft_and_rewinds_to_what_was_accepted(tiny_loaded):
    grammars, tokenizer = grammar(tiny_loaded)
    constraint = json_constraint(SCHEMA, strict=True, param="p")
    answer = tokenizer.encode('{"a":12}')
    think = [7, 8]
    for reasoning in (False, True):
        proc = ConstraintProcessor(
            grammars.matcher(constraint), think_end=think, reasoning=reasoning, metal=False
        )
        before = (think if reasoning else []) + answer
        assert proc.allowed(before) == len(before)
        assert proc.allowed([*before[:-2], 5, 6]) == len(before) - 2  # 5 is not JSON here
        mark = proc.mark()
        for token in before:
            proc._consume([token])
        assert proc.matcher.is_accepting() and proc.active
        proc.rewind(mark)
        assert proc.mark() == mark and proc.active is not reasoning
        assert proc.allowed(before) == len(before)
        proc._consume(before)
        budget = ReasoningBudget(4, think_start=[6], think_end=think, reasoning=False, inner=proc)
        assert budget.allowed([5]) == 0
        mark = budget.mark()
        budget._consume(6)
        budget._consume(5)
        assert budget.state == "reasoning" and budget.spent == 1
        budget.rewind(mark)
        assert budget.state == "before" and budget.spent == 0 and budget.mark() == mark


class _Batch:
    """The parts of mlx-lm's GenerationBatch a walk reads."""

    def __init__(self, processors, history):
        self.uids = list(range(len(processors)))
        self.logits_processors = processors
        self._token_context = [TokenBuffer(h) for h in history]


def test_penalties_see_the_tokens_before_each_drafted_position():
    penalties = make_logits_processors({3: 1.0}, 1.5, 20, 0.5, 20, 0.7, 20)
    seen: list[list[int]] = []

    def spy(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    batch = _Batch([[*penalties, spy], []], [[1, 2], [1]])
    logits = mx.random.normal((2, 4, 10))
    drafts = [[4, 5, 4], [6]]
    walk = Walk(batch, [2, 7], drafts, None)  # type: ignore[arg-type]
    out, _ = walk.process(logits)
    assert seen == [[1, 2, 2], [1, 2, 2, 4], [1, 2, 2, 4, 5], [1, 2, 2, 4, 5, 4]]
    for j, tokens in enumerate(seen):
        want = logits[0, j : j + 1]
        for p in penalties:
            want = p(mx.array(tokens), want)
        assert mx.allclose(out[0, j], want[0]).item()
    assert mx.array_equal(out[1], logits[1]).item()  # no processors: untouched
    walk.settle(0, 2)
    assert batch._token_context[0].update_and_fetch(mx.array([9])).tolist() == [1, 2, 2, 4, 5, 9]


class _Poisoned:
    """An LLMatcher whose masks fail for good once it consumes ``poison`` (a limit hit)."""

    def __init__(self, real, poison: int):
        self.real, self.poison, self.broken = real, poison, False

    def consume_token(self, token):
        self.broken = self.broken or token == self.poison
        return self.real.consume_token(token)

    def compute_bitmask(self):
        return self.real.compute_bitmask()

    def is_error(self):
        return self.broken

    def get_error(self):
        return "Current row has too many items; max is 2000"

    def rollback(self, n):
        return not self.broken and self.real.rollback(n)

    def deep_copy(self):
        return _Poisoned(self.real.deep_copy(), self.poison)


def test_a_grammar_failing_at_a_rejected_position_does_not_fail_its_row(tiny_loaded):
    grammars, tokenizer = grammar(tiny_loaded)
    answer = tokenizer.encode('{"a":12}')  # {  "  a  "  :  1  2  }
    other = tokenizer.encode('{"b":12}')  # what the model chose instead of the drafted a
    assert other[:2] == answer[:2] and other[2] != answer[2]
    either = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    for took, fails in ((1, False), (2, True)):
        poisoned: Any = _Poisoned(
            grammars.matcher(json_constraint(either, strict=True, param="p")), answer[2]
        )
        proc = ConstraintProcessor(poisoned, metal=False)
        row = SimpleNamespace(matcher=proc, error=None, request=SimpleNamespace(fault=None))
        prompt = [5, 6]
        proc(mx.array(prompt), mx.zeros((1, 512)))
        batch = _Batch([[guard_processor(row, proc)]], [prompt])
        walk = Walk(batch, [answer[0]], [answer[1:4]], [row])  # type: ignore[arg-type]
        walk.process(mx.zeros((1, 4, 512)))
        assert isinstance(row.error, GrammarFailure) and walk.failed_at == {0: 2}
        walk.settle(0, took)
        if fails:  # the failing mask was needed: a plain step fails there too
            assert isinstance(row.error, GrammarFailure)
            continue
        assert row.error is None and not proc.matcher.is_error()
        # As after a plain step that emitted { and " then chose b: the grammar goes on.
        out = proc(mx.array([*prompt, *other[:3]]), mx.zeros((1, 512)))
        replayed: Any = proc.matcher
        assert proc._seen == 3 and replayed.real.validate_tokens(other[3:]) == 5
        assert mx.isfinite(out).any().item()
