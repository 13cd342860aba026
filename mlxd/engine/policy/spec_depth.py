"""How deep a batch speculates this step: a cost model keyed by batch width.

A step that verifies ``k`` drafted tokens per row runs ``rows * (1 + k)``
tokens through the model instead of ``rows``. While a forward is bound by
reading the weights, those extra tokens are nearly free; past the point
where it is bound by arithmetic, each one costs. The model says so with one
constant, ``saturation`` (``[speculative] saturation_tokens``): a forward of
``n`` tokens costs ``1 + n / saturation`` (a one-token forward costs 1), and
a speculative step pays a fixed ``OVERHEAD`` on top (it reads its tokens
back before drafting, which the plain step's pipelining avoids).

With a per-token acceptance ``a``, a row emits ``1 + a + ... + a^k`` tokens
per step at depth ``k``. The chosen depth maximizes tokens per unit of cost;
when no depth beats plain decoding, it is 0 and the step is mlx-lm's own.
The acceptance is measured (:class:`Acceptance`) and decays back to a prior
when nothing is drafted, so a batch that stopped speculating tries again.

Pure: no MLX, no I/O (tests/unit/test_spec_depth.py).
"""

from __future__ import annotations

from dataclasses import dataclass

OVERHEAD = 0.05
PRIOR = 0.5
PRIOR_WEIGHT = 8.0
DECAY = 0.98


def expected_tokens(depth: int, acceptance: float) -> float:
    """Tokens a row emits per step at ``depth``: ``1 + a + ... + a^depth``."""
    return sum(acceptance**j for j in range(depth + 1))


def step_cost(rows: int, depth: int, saturation: int) -> float:
    """A step's cost relative to a plain one-token step of the same batch."""
    plain = 1 + rows / saturation
    cost = (1 + rows * (1 + depth) / saturation) / plain
    return cost * (1 + OVERHEAD) if depth else cost


def choose_depth(rows: int, max_depth: int, acceptance: float, saturation: int) -> int:
    """The depth (0..``max_depth``) with the most tokens per unit of cost for ``rows`` rows."""
    if rows <= 0 or max_depth <= 0:
        return 0
    best, best_gain = 0, 1.0
    for depth in range(1, max_depth + 1):
        gain = expected_tokens(depth, acceptance) / step_cost(rows, depth, saturation)
        if gain > best_gain + 1e-9:
            best, best_gain = depth, gain
    return best


@dataclass
class Acceptance:
    """The measured share of drafted tokens accepted, decayed toward ``PRIOR`` every step."""

    drafted: float = 0.0
    accepted: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR * PRIOR_WEIGHT) / (self.drafted + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        """One step: ``drafted`` tokens verified, ``accepted`` of them kept (0, 0: no draft)."""
        self.drafted = self.drafted * DECAY + drafted
        self.accepted = self.accepted * DECAY + accepted
