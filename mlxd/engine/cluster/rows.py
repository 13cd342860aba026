"""A row on the wire: rank 0's :class:`Row` as a :class:`RowSpec`, and back as a follower's row.

A spec carries what every rank needs to run the row (token ids, sampling,
penalties, grammar), never its text. A follower's row is a real
:class:`Row` whose events go nowhere: followers run the row's tokens and
report nothing, rank 0 answers the client.
"""

from __future__ import annotations

import time

from mlxd.engine.channel import Channel
from mlxd.engine.chat.intake import constraint_processor
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.output import OutputSplitter
from mlxd.engine.chat.reasoning_budget import make_budget
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.stops import TextStream
from mlxd.engine.cluster.plan import GrammarSpec, RowSpec
from mlxd.engine.messages import (
    Constraint,
    Event,
    Failed,
    GenerationRequest,
    PenaltyParams,
    SamplingParams,
    TokenPrompt,
)


class Desync(Exception):
    """This rank's state does not match what rank 0's plan expects."""


def row_spec(row: Row) -> RowSpec:
    """What rank 0 sends of ``row`` when it joins a lane."""
    r = row.request
    s, p = r.sampling, r.penalties
    c = r.constraint
    return RowSpec(
        id=r.id,
        lane=row.lane,
        prompt=list(row.prompt),
        max_tokens=row.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=[(int(k), float(v)) for k, v in p.logit_bias],
        logprobs=r.logprobs,
        top_logprobs=r.top_logprobs,
        fault=r.fault,
        constraint=GrammarSpec(c.kind, c.grammar, c.key, c.tool_format) if c else None,
        reasoning=row.matcher is not None and not getattr(row.matcher, "active", True),
        cached=row.extent.cached,
        reasoning_budget=r.reasoning_budget,
    )


class _Unread(Channel):
    """A follower's row has no reader: its events go nowhere."""

    def __init__(self) -> None:
        self.reader_gone = True

    def push(self, event: Event) -> None:
        return None


def follower_row(spec: RowSpec, loaded: LoadedModel) -> Row:
    """The row rank 0 described, on this rank's shard of ``loaded``.

    Raises:
        Desync: this rank cannot build the row's grammar (rank 0 could).
    """
    g = spec.constraint
    constraint = Constraint(g.kind, g.grammar, g.key, g.tool_format) if g else None
    request = GenerationRequest(
        id=spec.id,
        prompt=TokenPrompt(tuple(spec.prompt)),
        max_tokens=spec.max_tokens,
        sampling=SamplingParams(spec.temperature, spec.top_p, spec.top_k, spec.min_p, spec.seed),
        penalties=PenaltyParams(
            spec.repetition_penalty,
            spec.presence_penalty,
            spec.frequency_penalty,
            tuple((int(k), float(v)) for k, v in spec.logit_bias),
        ),
        logprobs=spec.logprobs,
        top_logprobs=spec.top_logprobs,
        fault=spec.fault,
        constraint=constraint,
        reasoning_budget=spec.reasoning_budget,
    )
    matcher = None
    phase = "reasoning" if spec.reasoning else "normal"
    if constraint is not None:
        # The same grammar mask rank 0 applies: every rank must sample the same tokens.
        matcher = constraint_processor(loaded, constraint, phase)
        if isinstance(matcher, Failed):
            raise Desync(f"this rank cannot build the row's grammar: {matcher.message}")
    matcher = make_budget(loaded.tokenizer, spec.reasoning_budget, phase, matcher)
    tokenizer = loaded.tokenizer
    return Row(
        request=request,
        channel=_Unread(),
        lane=spec.lane,
        reason="cluster",
        prompt=list(spec.prompt),
        max_tokens=spec.max_tokens,
        # Never fed (a follower's lanes only sample); real so that the row is whole.
        text=TextStream(tokenizer.detokenizer, ()),
        tokenizer=tokenizer,
        output=OutputSplitter(tokenizer, reasoning=False),
        matcher=matcher,
        received_mono=time.monotonic(),
        received_wall=time.time(),
    )
