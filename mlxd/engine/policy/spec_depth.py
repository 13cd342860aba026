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
The formula is only the start: the step times are measured too
(:class:`StepCosts`, by rows and tokens per row), and a measured ratio of a
verify step to a plain step of the same rows replaces the formula's, so a
machine where extra tokens are not free (a CPU) learns to stop drafting.

Pure: no MLX, no I/O (tests/unit/test_spec_depth.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def choose_depth(
    rows: int,
    max_depth: int,
    acceptance: float,
    saturation: int,
    measured: StepCosts | None = None,
) -> int:
    """The depth (0..``max_depth``) with the most tokens per unit of cost for ``rows`` rows.

    A step cost measured for ``rows`` rows at that width (``measured``) wins
    over the formula.
    """
    if rows <= 0 or max_depth <= 0:
        return 0
    best, best_gain = 0, 1.0
    for depth in range(1, max_depth + 1):
        ratio = measured.ratio(rows, 1 + depth) if measured is not None else None
        cost = ratio if ratio is not None else step_cost(rows, depth, saturation)
        gain = expected_tokens(depth, acceptance) / cost
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


@dataclass
class StepCosts:
    """Measured seconds per decode step by (rows, tokens per row), as moving averages.

    Width 1 is a plain step; a verify step's width is 1 + its longest draft,
    and its time includes drafting (a draft model's forwards count there).
    """

    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    weight: float = 0.2

    def record(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        before = self.seconds.get(key)
        self.seconds[key] = seconds if before is None else before + self.weight * (seconds - before)

    def ratio(self, rows: int, width: int) -> float | None:
        """A verify step of ``width`` over a plain step, both measured at ``rows`` rows."""
        plain, wide = self.seconds.get((rows, 1)), self.seconds.get((rows, width))
        if plain is None or wide is None or plain <= 0:
            return None
        return wide / plain
