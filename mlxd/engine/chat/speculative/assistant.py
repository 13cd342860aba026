"""Gemma 4 assistant drafting: a row's draft from the target's hidden state and batch KV.

The assistant (:mod:`.assistant_model`) has no cache of its own, so nothing
of it needs rolling back: it reads, at drafting time, the target's batch
cache as the last verify step left it (every rejected position already
dropped, :mod:`.rollback`), and the target's hidden state (after its final
norm) at the row's last cached position, the one its pending token was
chosen from.

That hidden state comes from a verify step run through
:meth:`AssistantDrafter.forward` (the target's own forward, the same logits,
keeping the hidden states; :meth:`AssistantDrafter.observe` keeps each row's).
A plain step (mlx-lm's own, pipelined) and a prefill keep none: a row
without a current hidden state drafts nothing, and when no row has one the
speculator runs a verify step without drafts to get them (as MTP heads do).

A row's keys and values are taken out of the batch cache with mlx-lm's own
``extract`` (left padding dropped, a rotated window put in order), a copy
of two layers per drafting row and step; a sliding layer is cut to the last
``window - 1`` positions (what the token at the pending position sees with
its own). Rows draft one after another, ``depth`` small forwards each. A
batch whose cache is neither ``BatchKVCache`` nor ``BatchRotatingKVCache``
(a quantized KV cache, ``kv_bits``) drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from mlxd.engine.chat.speculative.assistant_model import AssistantModel
from mlxd.engine.chat.speculative.verify import survivors


@dataclass
class _Row:
    """What a row drafts from: the hidden state its pending token was chosen from."""

    # len(tokens) and the pending token when it was kept (it is current while they hold).
    length: int
    pending: int
    hidden: mx.array


class AssistantDrafter:
    """Per-row state of one batch lane drafting with a Gemma 4 assistant, keyed by row uid."""

    def __init__(self, model: AssistantModel):
        self.model = model
        self._rows: dict[int, _Row] = {}
        # The last verify forward's hidden states (rows x width x hidden).
        self._hidden: mx.array | None = None
        # The batch being drafted for (attend) and its rows' indexes by uid.
        self._batch: GenerationBatch | None = None
        self._at: dict[int, int] = {}

    def forward(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """The target's logits for ``inputs``, keeping its hidden states for :meth:`observe`."""
        self._hidden, logits = self.model.forward(inputs, cache)
        return logits

    def attend(self, batch: GenerationBatch) -> None:
        """Draft for ``batch``'s rows (its cache as it is now) until the next call."""
        self._batch = batch
        self._at = {uid: i for i, uid in enumerate(batch.uids)}

    def propose(self, uid: int, tokens: list[int], pending: int, k: int) -> list[int]:
        """``k`` greedy tokens after ``tokens + [pending]``; none without a current hidden state."""
        row = self._rows.get(uid)
        i = self._at.get(uid)
        if (
            k <= 0
            or row is None
            or i is None
            or row.length != len(tokens)
            or row.pending != pending
        ):
            return []
        shared = self._shared(i)
        if shared is None:
            return []
        kv, at = shared
        model = self.model
        embeds = model.embed(mx.array([[pending]]))
        hidden = row.hidden[None, None]
        out: list[mx.array] = []
        for _ in range(k):
            h, hidden = model.module(embeds, hidden, kv, at)
            y = model.module.choose(h)[:, -1]
            out.append(y)
            embeds = model.embed(y[:, None])
        mx.eval(out)
        return cast("list[int]", mx.concatenate(out).tolist())

    def _shared(self, i: int) -> tuple[dict[str, tuple[mx.array, mx.array]], int] | None:
        """Row ``i``'s keys and values per layer type, and the position after them."""
        assert self._batch is not None
        caches = self._batch.prompt_cache
        kv: dict[str, tuple[mx.array, mx.array]] = {}
        positions: set[int] = set()
        for kind, index in self.model.layers.items():
            cache = caches[index]
            if type(cache) not in (BatchKVCache, BatchRotatingKVCache):
                return None
            one = cache.extract(i)
            keys, values = one.keys, one.values
            positions.add(int(one.offset))
            keep = self.model.window - 1
            if kind == "sliding_attention" and 0 < keep < keys.shape[2]:
                keys, values = keys[:, :, -keep:, :], values[:, :, -keep:, :]
            kv[kind] = (keys, values)
        if len(positions) != 1:
            return None
        return kv, positions.pop()

    def observe(
        self, batch: GenerationBatch, uids: list[int], drafts: list[list[int]], accepted: list[int]
    ) -> None:
        """After a verify step: each row still in ``batch`` keeps the hidden state of its last
        kept position.

        ``uids`` and ``accepted`` are per row of the batch before the step (the
        order of the forward's hidden states); ``drafts`` is unused (the MTP
        drafter's signature).
        """
        del drafts
        hidden, self._hidden = self._hidden, None
        self._batch, self._at = None, {}
        if hidden is None or not batch.uids:
            return
        for j, r, pending in survivors(batch, uids):
            self._rows[uids[r]] = _Row(len(batch.tokens[j]), pending, hidden[r, accepted[r]])

    def forget(self, live: set[int]) -> None:
        """Drop the state of rows no longer in the batch."""
        for uid in [u for u in self._rows if u not in live]:
            del self._rows[uid]
