"""MTP drafting: each row's draft from the target's last hidden state and the model's MTP head.

The head takes the pair (the target's hidden state at a position, the token
at the next position) and predicts the token after that. A row's pending
token was chosen from the hidden state of its last cached position, so that
pair drafts its first token; deeper drafts feed the head's own output back.

Where the hidden states come from: verify steps run the target through
:meth:`MtpDrafter.forward` (the target's trunk and head, the same logits),
which keeps the hidden states, and after the step each row remembers the
pairs of the positions it kept (:meth:`MtpDrafter.observe`). A plain step
(mlx-lm's own, pipelined) keeps none, nor does a prefill: a row without a
current pair drafts nothing, and when no row has one the speculator runs a
verify step without drafts to get them.

The head's own KV cache per row (one ``KVCache`` per row, as draft models
have) holds the pairs of the row's positions since the row last had a gap
(a plain step, a new row, a restart): the prompt's positions are never in
it, and a gap starts it afresh. The pairs drafting fed beyond the pending
token (built on the head's own guesses) are cut off after drafting and the
verified ones fed instead. Rows draft one after another: ``rows x depth``
small forwards per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from mlxd.engine.chat.speculative.mtp_head import MtpHead


@dataclass
class _Row:
    """One row's MTP state: its head cache and the pairs not yet fed to it."""

    cache: list[Any] | None = None
    # The position the cache's next entry is for (its entries are contiguous before it).
    covered: int = -1
    # Pairs (the target's hidden state at position p - 1, the token at position p), from `start`.
    start: int = 0
    hiddens: list[mx.array] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class MtpDrafter:
    """Per-row MTP state of one batch lane, keyed by the batch's row uid."""

    def __init__(self, head: MtpHead):
        self.head = head
        self._rows: dict[int, _Row] = {}
        # The last verify forward's hidden states (rows x width x hidden).
        self._hidden: mx.array | None = None

    def forward(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """The target's logits for ``inputs``, keeping its hidden states for :meth:`observe`."""
        hidden = self.head.trunk(inputs, cache)
        self._hidden = hidden
        return self.head.head(hidden)

    def ready(self, uid: int, tokens: list[int], pending: int) -> bool:
        """Whether the row has the pair that drafts after ``pending``."""
        row = self._rows.get(uid)
        return (
            row is not None
            and bool(row.tokens)
            and row.start + len(row.tokens) == len(tokens) + 1
            and row.tokens[-1] == pending
        )

    def propose(self, uid: int, tokens: list[int], pending: int, k: int) -> list[int]:
        """``k`` greedy tokens after ``tokens + [pending]``; none without a current pair."""
        if k <= 0 or not self.ready(uid, tokens, pending):
            return []
        row = self._rows[uid]
        head = self.head
        if row.cache is None or row.covered != row.start:
            row.cache = head.make_cache()  # a gap: the head's context starts here
        embeds = head.embed(mx.array([row.tokens]))
        hiddens = mx.stack(row.hiddens)[None]
        to_head, hidden = head.module(embeds, hiddens, row.cache)
        y = mx.argmax(head.head(to_head[:, -1, :]), axis=-1)
        out = [y]
        for _ in range(k - 1):
            to_head, hidden = head.module(head.embed(y[:, None]), hidden[:, -1:, :], row.cache)
            y = mx.argmax(head.head(to_head[:, -1, :]), axis=-1)
            out.append(y)
        mx.eval(out)
        if k > 1:  # entries built on the head's own guesses: the verified ones replace them
            for c in row.cache:
                c.trim(k - 1)
        row.covered = len(tokens) + 1
        row.start, row.hiddens, row.tokens = row.covered, [], []
        return cast("list[int]", mx.concatenate(out).tolist())

    def observe(
        self, batch: GenerationBatch, uids: list[int], drafts: list[list[int]], accepted: list[int]
    ) -> None:
        """After a verify step: each row still in ``batch`` keeps the pairs of what it kept.

        ``uids``, ``drafts`` and ``accepted`` are per row of the batch before
        the step (the order of the forward's hidden states).
        """
        hidden, self._hidden = self._hidden, None
        if hidden is None or not batch.uids:
            return
        at = {uid: r for r, uid in enumerate(uids)}
        assert batch._next_tokens is not None
        pending = cast("list[int]", batch._next_tokens.tolist())
        for j, uid in enumerate(batch.uids):
            r = at.get(uid)
            if r is None:
                continue
            took = accepted[r]
            row = self._rows.setdefault(uid, _Row())
            row.start = len(batch.tokens[j]) - took
            row.hiddens = [hidden[r, i] for i in range(took + 1)]
            row.tokens = [*drafts[r][:took], pending[j]]

    @property
    def nbytes(self) -> int:
        """Bytes every row's head cache holds (they count in the batch's KV bytes)."""
        return sum(c.nbytes for row in self._rows.values() for c in row.cache or [])

    def forget(self, live: set[int]) -> None:
        """Drop the state of rows no longer in the batch."""
        for uid in [u for u in self._rows if u not in live]:
            del self._rows[uid]
