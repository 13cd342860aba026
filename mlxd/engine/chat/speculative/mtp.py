"""MTP drafting: each row's draft from the target's last hidden state and the model's MTP head.

The head takes the pair (the target's hidden state at a position, the token
at the next position) and predicts the token after that. A row's pending
token was chosen from the hidden state of its last cached position, so that
pair drafts its first token; deeper drafts feed the head's own output back.

Where the hidden states come from: verify steps run the target through
:meth:`MtpDrafter.forward` (the target's trunk and head, the same logits),
which keeps the hidden states, and after the step each row remembers the
pairs of the positions it kept (:meth:`MtpDrafter.observe`). A prefill
feeds the prompt's (:mod:`.mtp_prefill`, :meth:`MtpDrafter.prefilled`), so
a new row drafts at its first step. A plain step (mlx-lm's own, pipelined)
keeps none: a row without a current pair drafts nothing, and when no row
has one the speculator runs a verify step without drafts to get them.

The head's own KV cache per row (one ``KVCache`` per row, as draft models
have) holds the pairs of the row's positions since the row last had a gap
(a plain step, a restart; the prompt's cached prefix on a prompt-cache hit,
which no chunk prefilled): a gap starts it afresh. The pairs drafting fed beyond the pending
token (built on the head's own guesses) are cut off after drafting and the
verified ones fed instead.

Rows draft together (:meth:`MtpDrafter.propose_rows`): one head forward per
depth for every row that has a pair. Their caches, of different lengths, are
merged into one mlx-lm ``BatchKVCache`` (left-padded, as the batch's own);
the first forward takes each row's pairs right-padded to the longest, the
padding rolled to the left afterwards (``prepare(right_padding)`` /
``finalize()``, as a chunked prefill), and each row reads its output at its
own last pair; deeper forwards are one token a row. Afterwards the guesses'
entries are trimmed and each row's cache extracted again. Merging and
extracting copy the rows' head caches once a step (one layer's KV of the
positions since each row's last gap); grouping rows by equal cache length
instead would copy nothing but, as rows accept different counts, leave
groups of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from mlxd.engine.chat.speculative.mtp_head import MtpHead
from mlxd.engine.chat.speculative.verify import survivors


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

    def prefilled(
        self, uids: list[int], before: list[int], chunks: list[list[int]], hidden: mx.array
    ) -> None:
        """A prefill chunk ran: each row's pairs fed to its head cache (:mod:`.mtp_prefill`).

        Row ``r`` (``uids[r]``) had ``before[r]`` tokens in its cache and
        prefilled ``chunks[r]``, whose hidden states are ``hidden[r]`` (right-padded
        to the longest chunk). A row whose last chunk ended where this one starts
        continues its head cache; any other starts it afresh here.
        """
        head = self.head
        fed: list[Any] = []
        for r, (uid, at, chunk) in enumerate(zip(uids, before, chunks, strict=True)):
            n = len(chunk)
            if n == 0:
                continue
            states = hidden[r, :n]
            row = self._rows.get(uid)
            if row is not None and row.cache is not None and row.covered == at == row.start:
                if row.tokens or len(row.hiddens) != 1:  # not where a chunk left it
                    row.cache = head.make_cache()
                    pairs, tokens = states[:-1], chunk[1:]
                else:
                    pairs, tokens = mx.concatenate([row.hiddens[0][None], states[:-1]]), chunk
            else:
                row = self._rows[uid] = _Row(cache=head.make_cache())
                pairs, tokens = states[:-1], chunk[1:]
            assert row.cache is not None
            if tokens:
                head.module(head.embed(mx.array([tokens])), pairs[None], row.cache)
                fed.extend(c.state for c in row.cache)
            row.covered = row.start = at + n
            row.hiddens, row.tokens = [states[-1]], []
            fed.append(states[-1])
        mx.eval(fed)

    def ready(self, uid: int, tokens: list[int], pending: int) -> bool:
        """Whether the row has the pair that drafts after ``pending``."""
        row = self._rows.get(uid)
        if (
            row is not None
            and not row.tokens
            and len(row.hiddens) == 1 == row.start - len(tokens) + 1
        ):
            row.tokens = [pending]  # prefilled (.mtp_prefill): the pending token completes its pair
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

    def propose_rows(self, asks: list[tuple[int, list[int], int, int]]) -> list[list[int]]:
        """:meth:`propose` for each ``(uid, tokens, pending, k)``, one head forward per depth.

        Each row gets what :meth:`propose` alone would give it (up to float
        rounding in the batched matmuls) and its head cache ends the same.
        """
        out: list[list[int]] = [[] for _ in asks]
        ready = [
            j for j, (uid, tok, pend, k) in enumerate(asks) if k > 0 and self.ready(uid, tok, pend)
        ]
        if len(ready) <= 1:
            for j in ready:
                out[j] = self.propose(*asks[j])
            return out
        head = self.head
        rows = [self._rows[asks[j][0]] for j in ready]
        kept: list[list[Any]] = []
        for row in rows:
            if row.cache is None or row.covered != row.start:
                row.cache = head.make_cache()  # a gap: the head's context starts here
            kept.append(row.cache)
        lengths = [len(row.tokens) for row in rows]
        width, count = max(lengths), len(rows)
        caches = [kept[0][i].merge([c[i] for c in kept]) for i in range(head.layers)]
        for cache in caches:
            cache.prepare(right_padding=[width - n for n in lengths])
        size = rows[0].hiddens[0].shape[-1]
        pad = mx.zeros((width, size), rows[0].hiddens[0].dtype)
        hiddens = mx.stack(
            [mx.concatenate([mx.stack(r.hiddens), pad[: width - len(r.hiddens)]]) for r in rows]
        )
        tokens = mx.array([r.tokens + [0] * (width - len(r.tokens)) for r in rows])
        to_head, hidden = head.module(head.embed(tokens), hiddens, caches)
        for cache in caches:
            cache.finalize()
        at = (mx.arange(count), mx.array(lengths) - 1)  # each row's last pair
        y = mx.argmax(head.head(to_head[at]), axis=-1)
        hidden = hidden[at][:, None, :]
        drafted = [y]
        k = max(asks[j][3] for j in ready)
        for _ in range(k - 1):
            to_head, hidden = head.module(head.embed(y[:, None]), hidden, caches)
            y = mx.argmax(head.head(to_head[:, -1, :]), axis=-1)
            drafted.append(y)
        for cache in caches:  # entries built on the head's own guesses
            cache.trim(k - 1)
        mx.eval(drafted, [c.state for c in caches])
        by_row = cast("list[list[int]]", mx.stack(drafted, axis=1).tolist())
        for r, (j, row) in enumerate(zip(ready, rows, strict=True)):
            _uid, toks, _pending, want = asks[j]
            row.cache = [cache.extract(r) for cache in caches]
            row.covered = len(toks) + 1
            row.start, row.hiddens, row.tokens = row.covered, [], []
            out[j] = by_row[r][:want]
        return out

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
        for j, r, pending in survivors(batch, uids):
            took = accepted[r]
            row = self._rows.setdefault(uids[r], _Row())
            row.start = len(batch.tokens[j]) - took
            row.hiddens = [hidden[r, i] for i in range(took + 1)]
            row.tokens = [*drafts[r][:took], pending]

    @property
    def nbytes(self) -> int:
        """Bytes every row's head cache holds (they count in the batch's KV bytes)."""
        return sum(c.nbytes for row in self._rows.values() for c in row.cache or [])

    def forget(self, live: set[int]) -> None:
        """Drop the state of rows no longer in the batch."""
        for uid in [u for u in self._rows if u not in live]:
            del self._rows[uid]
