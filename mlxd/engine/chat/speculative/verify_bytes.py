"""The memory a verify step needs on top of the batch's caches, read off the batch's own arrays.

A verify step of ``rows`` rows at depth ``d`` runs ``d + 1`` positions per
row (:mod:`.verify`). Until it commits, it holds:

- **logits**: the forward's ``rows x (d + 1) x vocab`` logits and their
  log-probabilities (the same shape again), in the logits' dtype. The vocab
  and the dtype are the previous step's log-probabilities' (a row's
  ``_next_logprobs``), which are exactly one position of these.
- **recurrent states** (Qwen3.5/3.6, Qwen3-Next, Mamba-2, Falcon-H1, see
  :mod:`.rollback`): every position's state of every recurrent layer, and
  the commit's stack of them when rows keep different counts (so twice
  ``d + 1`` states per row and layer), and each layer's convolution input
  (its window plus the ``d + 1`` new positions).

The draft model's and the MTP head's per-row caches are not transient: they
stay with the row while it speculates (``Drafter.nbytes``,
``MtpDrafter.nbytes``) and count in the batch's KV bytes.

Not counted: the forward's activations and attention scores (a plain step
has them too, ``d + 1`` times smaller), an MTP or assistant forward's hidden
states (``rows x (d + 1) x hidden``, small next to the vocab), and a KV
cache's growth by one 256-token block (a plain step grows it the same way).
Measured against the arrays a verify step really holds on tiny models in
tests/engine/test_spec_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import ArraysCache

from mlxd.engine.chat.speculative.rollback import leaves

# A position's logits are held twice: the forward's and their log-probabilities.
LOGIT_COPIES = 2
# A recurrent layer's per-position states are held twice: as recorded, and stacked by
# the commit when rows keep different counts.
STATE_COPIES = 2


@dataclass(frozen=True)
class VerifyBytes:
    """One batch's verify-step bytes, per row: by position of the step, and fixed.

    Args:
        logits: one position's logits and log-probabilities.
        states: one position's recorded recurrent states (and the commit's copy)
            and convolution inputs, over every recurrent layer.
        windows: the convolution windows every recurrent layer's recorded input
            repeats (once per step).
        draft: the draft model's or MTP head's caches (steady, held between steps).
    """

    logits: int = 0
    states: int = 0
    windows: int = 0
    draft: int = 0

    def transient(self, rows: int, depth: int) -> int:
        """Bytes a verify step of ``rows`` rows at ``depth`` holds until it commits (0 at 0)."""
        if rows <= 0 or depth <= 0:
            return 0
        return rows * ((depth + 1) * (self.logits + self.states) + self.windows)

    def steady(self, rows: int) -> int:
        """The draft or MTP caches of ``rows`` rows."""
        return max(rows, 0) * self.draft


def verify_bytes(batch: GenerationBatch, draft_bytes: int = 0) -> VerifyBytes:
    """What a verify step over ``batch`` needs, from its caches and last log-probabilities.

    ``draft_bytes``: the drafter's caches over the whole batch now (divided per row).
    """
    rows = max(len(batch.uids), 1)
    logits = 0
    previous = batch._next_logprobs
    if previous:
        logits = LOGIT_COPIES * int(previous[0].nbytes)
    states = windows = 0
    for cache in leaves(list(batch.prompt_cache or [])):
        if type(cache) is not ArraysCache or len(cache.cache) != 2:
            continue
        window, state = cache.cache
        if state is not None:
            states += STATE_COPIES * int(state.nbytes) // rows
        if window is not None:
            per_position = _row_bytes(window) // max(window.shape[1], 1)
            states += per_position
            windows += _row_bytes(window)
    return VerifyBytes(logits, states, windows, draft_bytes // rows)


def _row_bytes(array: Any) -> int:
    """One row's bytes of a batch-first array."""
    return int(array.nbytes) // max(int(array.shape[0]), 1)
