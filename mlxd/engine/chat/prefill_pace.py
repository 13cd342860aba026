"""How many prompt tokens one batch step prefills: the token cap, shrunk to a time budget.

mlx-lm's ``BatchGenerator`` prefills every joining row one chunk of up to
``prefill_step_size`` tokens per step, between two decode steps. What a
chunk costs depends on the model and on the position (attention reads every
earlier token): the 512 tokens that take 50 ms at the start of a prompt on a
small model take seconds deep into a 30k-token prompt on a large one, and
every decoding row, every joiner served from the cache and every cancel
waits that long. :class:`PrefillPace` measures the seconds per chunk token
of the steps that prefilled and sizes the next chunk so that a step's
prefill takes about ``[batch] prefill_step_seconds``, never more than
``prefill_step_size`` tokens nor fewer than :data:`MIN_CHUNK`. Pure: no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

# The smallest chunk: below it a forward pass costs mostly its fixed overhead.
MIN_CHUNK = 32
# The first chunk before anything was measured (a cold start may be slow).
FIRST_CHUNK = 128
# Weight of the newest measurement when the cost per token falls.
_EASE = 0.3


@dataclass
class PrefillPace:
    """The chunk width for the next step, from the cost of the last ones.

    Args:
        most: ``[batch] prefill_step_size``, the token cap.
        seconds: ``[batch] prefill_step_seconds``; 0 turns the time budget off.
    """

    most: int
    seconds: float
    # Smoothed seconds per token of chunk width; None until a prefill was measured.
    per_token: float | None = None

    def chunk(self) -> int:
        """Prompt tokens each prefilling row gets in the next step."""
        if self.seconds <= 0:
            return self.most
        if self.per_token is None:
            return min(self.most, FIRST_CHUNK)
        fits = int(self.seconds / self.per_token)
        return max(min(self.most, MIN_CHUNK), min(self.most, fits))

    def observe(self, width: int, seconds: float) -> None:
        """A step prefilled chunks up to ``width`` tokens wide in ``seconds``.

        A rising cost is taken at once (a step must not overrun twice); a
        falling one eases in, so one cheap step (a short joiner alone) does
        not make the next chunk too wide.
        """
        if width <= 0 or seconds <= 0:
            return
        rate = seconds / width
        last = self.per_token
        self.per_token = rate if last is None or rate > last else last + _EASE * (rate - last)
