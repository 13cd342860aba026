"""Speculator: a batch lane's drafts, depth and acceptance, around mlx-lm's generation batch.

Installed on a ``BatchGenerator``, it takes the place of its generation
batch's ``next()``: each decode step it chooses a depth from the batch width
and the measured acceptance (:mod:`mlxd.engine.policy.spec_depth`), drafts
for the rows that may speculate, and runs a verify step
(:mod:`.verify`); when there is nothing to draft, the depth is 0, or the
cache cannot drop per-row positions (sliding-window, recurrent and hybrid
models), the step is mlx-lm's own, unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

from mlxd.config import SpeculativeSettings
from mlxd.engine.chat.speculative.drafter import Drafter, DraftModel
from mlxd.engine.chat.speculative.lookup import NgramIndex
from mlxd.engine.chat.speculative.verify import (
    greedy_rows,
    pending_tokens,
    verifiable,
    verify,
)
from mlxd.engine.policy.spec_depth import (
    Acceptance,
    StepCosts,
    choose_depth,
    default_saturation,
)

logger = logging.getLogger(__name__)


@dataclass
class SpecTally:
    """Counts since the engine last read them: tokens drafted and accepted, verify steps."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    # Per row uid: (drafted, accepted) this tally.
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)


class Speculator:
    """One batch lane's speculation: settings, per-row n-gram indexes, acceptance, tallies."""

    def __init__(self, settings: SpeculativeSettings, draft: DraftModel | None = None):
        self.settings = settings
        self.acceptance = Acceptance()
        self.depth = 0
        self.tally = SpecTally()
        self.costs = StepCosts()
        # Rows of the last step when it was a plain one (0: it was not).
        self._plain_rows = 0
        self._indexes: dict[int, NgramIndex] = {}
        # mode = "draft": the draft model loaded with the target (None: nothing to draft with).
        self._drafter = Drafter(draft) if draft is not None else None
        # The cost model's prior when the config leaves saturation_tokens unset.
        self._saturation = default_saturation(mx.default_device().type == mx.DeviceType.gpu)

    def configure(self, settings: SpeculativeSettings) -> None:
        """New settings, live; the n-gram indexes are rebuilt when their lengths change."""
        if (settings.ngram_min, settings.ngram_max) != (
            self.settings.ngram_min,
            self.settings.ngram_max,
        ):
            self._indexes.clear()
        self.settings = settings

    def install(self, gen: BatchGenerator) -> None:
        """Step ``gen``'s generation batch through :meth:`next` from now on."""
        batch = gen._generation_batch
        plain = batch.next
        batch.next = lambda: self.next(batch, plain)

    def take(self) -> SpecTally:
        """The tally since the last call (the engine adds it to its counters)."""
        tally, self.tally = self.tally, SpecTally()
        return tally

    def next(
        self, batch: GenerationBatch, plain: Callable[[], list[GenerationBatch.Response]]
    ) -> list[GenerationBatch.Response]:
        settings = self.settings
        if settings.mode == "draft" and self._drafter is None:
            self.depth = 0  # the draft model loads with its target: a reload swaps it in
            return plain()
        if settings.mode == "off" or not batch.uids or not verifiable(batch):
            self.depth = 0
            return plain()
        rows = greedy_rows(batch)
        width = len(batch.uids)
        self.depth = depth = choose_depth(
            width,
            settings.max_draft_tokens,
            self.acceptance.rate,
            settings.saturation_tokens or self._saturation,
            self.costs,
        )
        if depth and self.costs.wants_plain(width):
            depth = self.depth = 0  # time a plain step at this width to compare verify steps with
        if not rows or depth == 0:
            self.acceptance.record(0, 0)
            return self._plain(width, plain)
        pending = pending_tokens(batch)
        started = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in batch.uids]
        for i in rows:
            room = batch.max_tokens[i] - batch._num_tokens[i] - 1
            if room > 0:
                drafts[i] = self._draft(
                    batch.uids[i], batch.tokens[i], pending[i], min(depth, room)
                )
        self._forget(batch.uids)
        if not any(drafts):
            self.acceptance.record(0, 0)
            return self._plain(width, plain)
        responses, verified = verify(batch, pending, drafts)
        self.costs.record(width, verified.width, time.perf_counter() - started)
        self._plain_rows = 0
        drafted, accepted = sum(verified.drafted), sum(verified.accepted)
        self.acceptance.record(drafted, accepted)
        tally = self.tally
        tally.drafted += drafted
        tally.accepted += accepted
        tally.steps += 1
        for uid, d, a in zip(verified.uids, verified.drafted, verified.accepted, strict=True):
            if d:
                before = tally.rows.get(uid, (0, 0))
                tally.rows[uid] = (before[0] + d, before[1] + a)
        return responses

    def _plain(
        self, rows: int, plain: Callable[[], list[GenerationBatch.Response]]
    ) -> list[GenerationBatch.Response]:
        """mlx-lm's own step, timed.

        It is pipelined: it waits for the previous step's forward, not its own,
        so only a plain step after a plain step of the same rows times one step.
        """
        started = time.perf_counter()
        responses = plain()
        if self._plain_rows == rows:
            self.costs.record(rows, 1, time.perf_counter() - started)
        self._plain_rows = rows
        return responses

    def _draft(self, uid: int, tokens: list[int], pending: int, k: int) -> list[int]:
        if self.settings.mode == "draft" and self._drafter is not None:
            return self._drafter.propose(uid, tokens, pending, k)
        index = self._indexes.get(uid)
        if index is None or len(index) > len(tokens) + 1:
            index = self._indexes[uid] = NgramIndex(
                self.settings.ngram_min, self.settings.ngram_max
            )
        index.extend(tokens[len(index) :])
        if len(index) == len(tokens):
            index.extend([pending])
        return index.propose(k)

    def _forget(self, uids: list[int]) -> None:
        if self._drafter is not None:
            self._drafter.forget(set(uids))
        if len(self._indexes) > len(uids):
            live = set(uids)
            for uid in [u for u in self._indexes if u not in live]:
                del self._indexes[uid]
