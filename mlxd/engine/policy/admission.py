"""KV-byte admission: how many bytes a batch will hold, and who may join it.

Pure functions over a :class:`CacheLayout` measured from the loaded model. The
facts they encode (see docs/batching.md):

- mlx-lm's batch caches share **one capacity** across rows: a batch of B rows
  holds B x (longest row's capacity), plus constant recurrent state per row.
- Capacity grows in steps of 256 tokens. A row that starts from a cached
  prefix starts at exactly the prefix length, then grows in steps.
- A sliding-window layer keeps at most its window, except that a prefill chunk
  is stored whole before being trimmed, so it may briefly hold the window plus
  one chunk.
- Recurrent (SSM) state is constant per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

KV_STEP = 256
GiB = 1024**3


@dataclass(frozen=True)
class LayerLayout:
    """One layer's cache: ``full`` grows per token, ``window`` caps, ``state`` is constant."""

    kind: Literal["full", "window", "state"]
    bytes_per_token: int = 0
    window: int = 0
    state_bytes: int = 0


@dataclass(frozen=True)
class CacheLayout:
    layers: tuple[LayerLayout, ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted({layer.kind for layer in self.layers}))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one row adds per token while every layer still grows."""
        return sum(layer.bytes_per_token for layer in self.layers if layer.kind != "state")


@dataclass(frozen=True)
class RowExtent:
    """A row's projected final length in tokens, and how much came from the prompt cache."""

    tokens: int
    cached: int = 0


def stepped(tokens: int, step: int = KV_STEP) -> int:
    """Round a token count up to mlx-lm's allocation step."""
    return -(-max(tokens, 0) // step) * step


def row_extent(
    prompt_tokens: int, max_tokens: int, decode_allowance: int, cached: int = 0
) -> RowExtent:
    """Tokens a row is projected to reach: its prompt plus the decode allowance."""
    return RowExtent(prompt_tokens + min(max_tokens, decode_allowance), min(cached, prompt_tokens))


def row_capacity(extent: RowExtent) -> int:
    """Token slots a row's cache will have allocated when it reaches ``extent``."""
    return extent.cached + stepped(extent.tokens - extent.cached)


def project_batch_bytes(
    layout: CacheLayout, rows: Sequence[RowExtent], prefill_step_size: int
) -> int:
    """Projected KV bytes of a batch holding ``rows``.

    Every row pays for the longest row's capacity (the batch caches share
    one), window layers cap at the window plus one prefill chunk, and state
    layers cost the same per row regardless of length.
    """
    if not rows:
        return 0
    n = len(rows)
    capacity = max(row_capacity(r) for r in rows)
    total = 0
    for layer in layout.layers:
        if layer.kind == "full":
            total += n * capacity * layer.bytes_per_token
        elif layer.kind == "window":
            total += n * min(capacity, layer.window + prefill_step_size) * layer.bytes_per_token
        else:
            total += n * layer.state_bytes
    return total


Waiting = Literal["batch_full", "budget"]


@dataclass(frozen=True)
class Admission:
    """The answer for the head of the pending queue."""

    admit: bool
    waiting_for: Waiting | None
    projected_bytes: int


def check_admission(
    layout: CacheLayout,
    running: Sequence[RowExtent],
    candidate: RowExtent,
    *,
    batch_size: int,
    budget: int,
    real_bytes: int,
    prefill_step_size: int,
) -> Admission:
    """May ``candidate`` join the ``running`` rows now?

    It may when a slot is free, the real bytes of the batch are within the
    budget (they can outgrow the projection when rows run past the decode
    allowance: then admission stops, and no running row is ever dropped), and
    the projection of the batch with the candidate fits the budget.
    """
    projected = project_batch_bytes(layout, [*running, candidate], prefill_step_size)
    if len(running) >= batch_size:
        return Admission(False, "batch_full", projected)
    if real_bytes > budget or projected > budget:
        return Admission(False, "budget", projected)
    return Admission(True, None, projected)


def never_fits(
    layout: CacheLayout, candidate: RowExtent, budget: int, prefill_step_size: int
) -> int | None:
    """The projected bytes if ``candidate`` alone exceeds ``budget``, else None."""
    alone = project_batch_bytes(layout, [candidate], prefill_step_size)
    return alone if alone > budget else None


def headroom_bytes(device_bytes: int) -> int:
    """Memory left alone for the OS, the runtime and transient activations."""
    return max(GiB, device_bytes // 5)


def auto_budget(device_bytes: int, weights_bytes: int, prompt_cache_bytes: int) -> int:
    """The KV budget for ``kv_budget = "auto"``.

    Device memory (Metal's recommended working set on macOS, physical memory
    elsewhere) minus the weights, the prompt-cache cap and a headroom of 20%
    of the device (at least 1 GiB). Never below 64 MiB, so a small machine
    still serves one short row at a time.
    """
    budget = device_bytes - weights_bytes - prompt_cache_bytes - headroom_bytes(device_bytes)
    return max(budget, 64 * 1024**2)
