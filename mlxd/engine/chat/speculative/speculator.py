"""Speculator: a batch lane's drafts, depth and acceptance, around mlx-lm's generation batch.

Installed on a ``BatchGenerator``, it takes the place of its generation
batch's ``next()``: each decode step it chooses a depth from the batch width
and the measured acceptance (:mod:`mlxd.engine.policy.spec_depth`), drafts
for the rows that may speculate, and runs a verify step
(:mod:`.verify`); when there is nothing to draft, the depth is 0, or the
cache cannot drop per-row positions (a family :mod:`.rollback` does not
know), the step is mlx-lm's own, unchanged. The depth is capped last so
the verify step's transient bytes (:mod:`.verify_bytes`) fit the room the
KV budget has left (:attr:`Speculator.room`, set by the engine each step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

from mlxd.config import SpeculativeSettings
from mlxd.engine.chat.speculative.assistant import AssistantDrafter
from mlxd.engine.chat.speculative.assistant_model import AssistantModel
from mlxd.engine.chat.speculative.constrained import cut, may_speculate
from mlxd.engine.chat.speculative.drafter import Drafter, DraftModel
from mlxd.engine.chat.speculative.lookup import NgramIndex
from mlxd.engine.chat.speculative.mtp import MtpDrafter
from mlxd.engine.chat.speculative.mtp_head import MtpHead
from mlxd.engine.chat.speculative.mtp_prefill import feed_prefill
from mlxd.engine.chat.speculative.rejection import samples
from mlxd.engine.chat.speculative.verify import (
    greedy_rows,
    pending_tokens,
    verifiable,
    verify,
)
from mlxd.engine.chat.speculative.verify_bytes import verify_bytes
from mlxd.engine.policy.spec_depth import (
    Acceptance,
    StepCosts,
    choose_depth,
    default_saturation,
    fit_depth,
    worth_verifying,
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

    def __init__(
        self,
        settings: SpeculativeSettings,
        draft: DraftModel | AssistantModel | MtpHead | None = None,
    ):
        self.settings = settings
        self.acceptance = Acceptance()
        self.depth = 0
        self.tally = SpecTally()
        self.costs = StepCosts()
        # Rows of the last step when it was a plain one (0: it was not).
        self._plain_rows = 0
        self._indexes: dict[int, NgramIndex] = {}
        # The lane's rows by uid and the model's end-of-sequence ids (set by the lane):
        # rows with logits processors speculate through them (.constrained).
        self.rows: Mapping[int, Any] = {}
        self.eos: frozenset[int] = frozenset()
        # mode = "draft": the draft model loaded with the target (None: nothing to draft with).
        # A Gemma 4 assistant (.assistant) drafts from the verify pass's hidden states, as MTP does.
        self._drafter: Drafter | AssistantDrafter | None = (
            Drafter(draft)
            if isinstance(draft, DraftModel)
            else AssistantDrafter(draft)
            if isinstance(draft, AssistantModel)
            else None
        )
        # mode = "mtp": the target's MTP head, loaded with it (mlxd.engine.chat.speculative.mtp).
        self._mtp = MtpDrafter(draft) if isinstance(draft, MtpHead) else None
        self._prompts: Any = None  # the lane's prompt batch (set by install)
        # The cost model's prior when the config leaves saturation_tokens unset.
        self._saturation = default_saturation(mx.default_device().type == mx.DeviceType.gpu)
        # The bytes the KV budget has left for a verify step's transients (None: not capped).
        self.room: int | None = None

    def configure(self, settings: SpeculativeSettings) -> None:
        """New settings, live; the n-gram indexes are rebuilt when their lengths change."""
        if (settings.ngram_min, settings.ngram_max) != (
            self.settings.ngram_min,
            self.settings.ngram_max,
        ):
            self._indexes.clear()
        self.settings = settings

    def install(self, gen: BatchGenerator) -> None:
        """Step ``gen``'s generation batch through :meth:`next` from now on (and, with an
        MTP head, feed it the prompt batch's prefill chunks: :mod:`.mtp_prefill`)."""
        batch = gen._generation_batch
        plain = batch.next
        batch.next = lambda: self.next(batch, plain)
        self._prompts = gen._prompt_batch
        if self._mtp is not None:
            self._mtp.forget(set())  # a new generator numbers its rows afresh
            feed_prefill(self._prompts, self._mtp, lambda: self.settings.mode == "mtp")

    def take(self) -> SpecTally:
        """The tally since the last call (the engine adds it to its counters)."""
        tally, self.tally = self.tally, SpecTally()
        return tally

    def next(
        self, batch: GenerationBatch, plain: Callable[[], list[GenerationBatch.Response]]
    ) -> list[GenerationBatch.Response]:
        settings = self.settings
        if (settings.mode == "draft" and self._drafter is None) or (
            settings.mode == "mtp" and self._mtp is None
        ):
            self.depth = 0  # the drafter loads with its target: a reload swaps it in
            return plain()
        if settings.mode == "off" or not batch.uids or not verifiable(batch):
            self.depth = 0
            return plain()
        width = len(batch.uids)
        lane = [self.rows.get(uid) for uid in batch.uids]
        greedy = set(greedy_rows(batch))
        rows = [
            i
            for i in range(width)
            if (i in greedy or samples(lane[i])) and may_speculate(batch, i, lane[i])
        ]
        self.depth = depth = choose_depth(
            width,
            settings.max_draft_tokens,
            self.acceptance.rate,
            settings.saturation_tokens or self._saturation,
            self.costs,
        )
        if depth and self.costs.wants_plain(width):
            depth = self.depth = 0  # time a plain step at this width to compare verify steps with
        if depth and self.room is not None:
            need = verify_bytes(batch, self.cache_bytes())
            depth = self.depth = fit_depth(depth, self.room, lambda d: need.transient(width, d))
        if not rows or depth == 0:
            self.acceptance.record(0, 0)
            return self._plain(width, plain)
        pending = pending_tokens(batch)
        started = time.perf_counter()
        assistant = self._drafter if isinstance(self._drafter, AssistantDrafter) else None
        if assistant is not None:
            assistant.attend(batch)
        drafts: list[list[int]] = [[] for _ in batch.uids]
        heads = self._mtp if settings.mode == "mtp" else None
        asks: list[tuple[int, list[int], int, int]] = []
        for i in rows:
            room = batch.max_tokens[i] - batch._num_tokens[i] - 1
            if room > 0:
                asks.append((batch.uids[i], batch.tokens[i], pending[i], min(depth, room)))
        asked = bool(asks)
        if heads is not None:  # every row's head in one forward per depth
            proposed = heads.propose_rows(asks)
        else:
            proposed = [self._draft(*ask) for ask in asks]
        at = {uid: i for i, uid in enumerate(batch.uids)}
        for (uid, _, _, _), draft in zip(asks, proposed, strict=True):
            i = at[uid]
            drafts[i] = cut(lane[i], self.eos, pending[i], draft)
        # MTP heads and a Gemma 4 assistant draft from the hidden states a verify step keeps.
        hidden = heads if heads is not None else assistant if settings.mode == "draft" else None
        if hidden is None and any(drafts) and not self._pays(drafts):
            drafts = [[] for _ in batch.uids]  # too few rows drafted to pay for the width
        # Rows that draft from hidden states: a verify step gets them when none has one.
        if not any(drafts) and (hidden is None or not asked):
            self.acceptance.record(0, 0)
            return self._plain(width, plain)
        uids = list(batch.uids)
        forward = hidden.forward if hidden is not None else None
        responses, verified = verify(batch, pending, drafts, forward, lane)
        if hidden is not None:
            hidden.observe(batch, uids, drafts, verified.accepted)
        if any(drafts):
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

    def _pays(self, drafts: list[list[int]]) -> bool:
        """Whether the drafts the rows made pay for their verify step's width."""
        saturation = self.settings.saturation_tokens or self._saturation
        lengths = [len(d) for d in drafts]
        return worth_verifying(lengths, self.acceptance.rate, saturation, self.costs)

    def cache_bytes(self) -> int:
        """Bytes the draft model's or MTP head's per-row caches hold now."""
        drafter = self._drafter if isinstance(self._drafter, Drafter) else None
        return sum(d.nbytes for d in (drafter, self._mtp) if d is not None)

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

    def forget(self, uids: list[int]) -> None:
        """Drop the per-row state (draft caches, indexes) of rows not in ``uids``; the lane
        calls it after every step and removal, so a row's state leaves with the row."""
        if self._drafter is not None:
            self._drafter.forget(set(uids))
        if self._mtp is not None:  # rows still prefilling keep what their chunks fed
            prefilling = self._prompts.uids if self._prompts is not None else []
            self._mtp.forget({*uids, *prefilling})
        if len(self._indexes) > len(uids):
            live = set(uids)
            for uid in [u for u in self._indexes if u not in live]:
                del self._indexes[uid]
