"""How deep a batch speculates this step: a cost model keyed by batch width.

A step that verifies ``k`` drafted tokens per row runs ``rows * (1 + k)``
tokens through the model instead of ``rows``. While a forward is bound by
reading the weights (a GPU), those extra tokens are nearly free; past the
point where it is bound by arithmetic (a CPU, even at a few tokens), each
one costs. The prior says so with one constant, ``saturation``
(``[speculative] saturation_tokens``; by default :data:`SATURATION_CPU` or
:data:`SATURATION_GPU` by backend): a forward of ``n`` tokens costs
``1 + n / saturation`` (a one-token forward costs 1), and a speculative step
pays a fixed ``OVERHEAD`` on top (it reads its tokens back before drafting,
which the plain step's pipelining avoids).

With a per-token acceptance ``a``, a row emits ``1 + a + ... + a^k`` tokens
per step at depth ``k``. The chosen depth maximizes tokens per unit of cost;
when no depth beats plain decoding, it is 0 and the step is mlx-lm's own.
The acceptance is measured (:class:`Acceptance`) and decays back to a prior
when nothing is drafted, so a batch that stopped speculating tries again.

The step times are measured too (:class:`StepCosts`, by rows and tokens per
row). A verify step's measured ratio to a plain step of the same rows is
the cost at that width (rows that have always speculated take plain steps
until one is timed: :meth:`StepCosts.wants_plain`). Where nothing is
measured, the prior predicts, scaled up by how much more than it said this batch width's
measured verify steps cost (never down); a predicted depth must beat plain
decoding by ``MARGIN`` and may be at most one deeper than the deepest
measured at these rows, so a wrong prior costs a few shallow steps, never a
wide batch's worth of deep ones. A row count that ran ``REFRESH`` plain steps
in a row forgets its verify measurements and explores again, so one slow
verify step (a cold first one, a burst of load) does not keep it plain for good.

Once the rows have drafted, the step is priced again with the drafts it
really has (:func:`worth_verifying`): rows without a draft gain nothing, and
a step whose drafts do not pay runs plain.

Memory caps the depth last (:func:`fit_depth`): a verify step holds every
position's logits and, on a recurrent model, every position's state until it
commits (:mod:`mlxd.engine.chat.speculative.verify_bytes`); the deepest
depth whose step fits the room the KV budget has left is taken, 0 when none does.

Pure: no MLX, no I/O (tests/unit/test_spec_policy.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

OVERHEAD = 0.05
MARGIN = 0.10
PRIOR = 0.5
PRIOR_WEIGHT = 8.0
DECAY = 0.98
# Plain steps after which a row count's verify measurements are forgotten, so
# one slow verify step (the first at a width, a burst of load) cannot keep a
# batch plain for good: at worst one shallow verify step per REFRESH steps.
REFRESH = 64
# The prior's saturation by backend: a CPU forward is compute-bound after a few
# tokens (the demo model on 2 cores: 16 tokens cost ~2x one); a GPU's is
# bandwidth-bound up to tens of tokens.
SATURATION_CPU = 8
SATURATION_GPU = 64


def default_saturation(gpu: bool) -> int:
    """``saturation_tokens`` when the config leaves it unset."""
    return SATURATION_GPU if gpu else SATURATION_CPU


def expected_tokens(depth: int, acceptance: float) -> float:
    """Tokens a row emits per step at ``depth``: ``1 + a + ... + a^depth``."""
    return sum(acceptance**j for j in range(depth + 1))


def step_cost(rows: int, depth: int, saturation: int) -> float:
    """A step's cost relative to a plain one-token step of the same batch (the prior)."""
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
    over the prediction; a predicted one must beat plain decoding by
    ``MARGIN`` and be at most one deeper than the deepest measured.
    """
    if rows <= 0 or max_depth <= 0:
        return 0
    costs = measured or StepCosts()
    explored = costs.deepest(rows) if measured is not None else max_depth
    scale = costs.calibration(rows, saturation)
    best, best_gain = 0, 1.0
    for depth in range(1, max_depth + 1):
        exact = costs.ratio(rows, 1 + depth)
        if exact is not None:
            cost, need = exact, 1.0
        elif depth > explored + 1:
            break
        else:
            cost, need = step_cost(rows, depth, saturation) * scale, 1.0 + MARGIN
        gain = expected_tokens(depth, acceptance) / cost
        if gain > need + 1e-9 and gain > best_gain + 1e-9:
            best, best_gain = depth, gain
    return best


def worth_verifying(
    drafts: list[int], acceptance: float, saturation: int, measured: StepCosts | None = None
) -> bool:
    """Whether verifying these drafts beats a plain step; ``drafts``: each row's draft length.

    :func:`choose_depth` assumes every row drafts the depth it picks; prompt
    lookup drafts only for rows whose suffix recurs, so a verify step can run
    every row at its widest draft's width for a few rows' gain (chat at four
    rows lost 14% so). This prices the step the drafts make: the rows' expected
    tokens against the cost of its width, by the same rules as the depth.
    """
    rows, longest = len(drafts), max(drafts, default=0)
    if rows == 0 or longest == 0:
        return False
    costs = measured or StepCosts()
    exact = costs.ratio(rows, 1 + longest)
    if exact is not None:
        cost, need = exact, 1.0
    else:
        scale = costs.calibration(rows, saturation)
        cost, need = step_cost(rows, longest, saturation) * scale, 1.0 + MARGIN
    tokens = sum(expected_tokens(d, acceptance) for d in drafts)
    return tokens / (rows * cost) > need + 1e-9


def fit_depth(depth: int, room: int | None, need: Callable[[int], int]) -> int:
    """The deepest depth up to ``depth`` whose verify step's bytes (``need(d)``) fit ``room``.

    ``room``: the bytes the KV budget has left (None: not capped). 0 when even
    depth 1 does not fit: the step is a plain one, which needs nothing extra.
    """
    if room is None:
        return depth
    while depth > 0 and need(depth) > room:
        depth -= 1
    return depth


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
    # Plain steps timed per row count since its last verify step.
    _plain_run: dict[int, int] = field(default_factory=dict)

    def record(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        before = self.seconds.get(key)
        self.seconds[key] = seconds if before is None else before + self.weight * (seconds - before)
        if width > 1:
            self._plain_run[rows] = 0
            return
        run = self._plain_run[rows] = self._plain_run.get(rows, 0) + 1
        if run >= REFRESH:
            # A verify measurement that kept these rows plain this long may be stale
            # (a first, cold step; a burst of load): forget it and explore again.
            for stale in [k for k in self.seconds if k[0] == rows and k[1] > 1]:
                del self.seconds[stale]
            self._plain_run[rows] = 0

    def ratio(self, rows: int, width: int) -> float | None:
        """A verify step of ``width`` over a plain step, both measured at ``rows`` rows."""
        plain, wide = self.seconds.get((rows, 1)), self.seconds.get((rows, width))
        if plain is None or wide is None or plain <= 0:
            return None
        return wide / plain

    def deepest(self, rows: int) -> int:
        """The deepest verify step measured at ``rows`` rows (0: none)."""
        return max((w - 1 for r, w in self.seconds if r == rows), default=0)

    def wants_plain(self, rows: int) -> bool:
        """Whether ``rows`` rows have verify steps measured but no plain step to compare."""
        return (rows, 1) not in self.seconds and self.deepest(rows) > 0

    def calibration(self, rows: int, saturation: int) -> float:
        """How much more than the prior this many rows' verify steps cost (at least 1)."""
        worst = 1.0
        for r, w in self.seconds:
            ratio = self.ratio(r, w) if r == rows and w > 1 else None
            if ratio is not None:
                worst = max(worst, ratio / step_cost(rows, w - 1, saturation))
        return worst
