"""KV-byte admission: how many bytes a batch will hold, and who may join it.

Pure functions over a :class:`CacheLayout` measured from the loaded model. The
facts they encode, measured against mlx-lm (see docs/batching.md, "The
projection", and ``tests/engine/test_kv_budget.py``, which checks them after
every step of a real ``BatchGenerator``):

- mlx-lm's batch caches share **one capacity** across rows: a batch of B rows
  holds B x (its longest row's position, left-padded, plus spare capacity).
- Capacity grows in steps of 256 tokens from the position where it runs out,
  so the spare capacity is always below one step (mlxd keeps it so: see
  :mod:`mlxd.engine.chat.kv_caches`).
- A row that starts from a cached prefix starts at exactly the prefix length.
- Rows prefilled together share one position: the furthest row's position
  plus the longest chunk of this round, until the round's finished rows leave
  the prompt batch. Rows that start together from the same prefix stay level;
  mixed prefix lengths, or a row joining a prefill under way, cost up to one
  chunk more while they prefill.
- A sliding-window layer keeps at most its window plus one prefill chunk.
- Recurrent (SSM) state is constant per row.

A lone row (a batch that was empty when it joined) is projected exactly; a
shared batch gets the bound above, which holds whatever order its rows end in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
    """What admission projects for a row.

    ``prompt`` tokens, of which ``cached`` come from the prompt cache, then
    ``decode`` generated tokens counted (``min(max_tokens, decode_allowance)``).
    ``cuts``: the prompt positions where its prefill stops for a checkpoint.
    ``prefilling`` until its first token, with ``prefilled`` prompt tokens
    done so far: rows prefilled together share a position (see the module
    docstring).
    """

    prompt: int
    decode: int = 0
    cached: int = 0
    prefilling: bool = True
    prefilled: int = 0
    cuts: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """The row's projected final length: prompt plus counted decode."""
        return self.prompt + self.decode

    @property
    def rest(self) -> int:
        """Prompt tokens left to prefill after the cached prefix."""
        return self.prompt - self.cached


def stepped(tokens: int, step: int = KV_STEP) -> int:
    """Round a token count up to mlx-lm's allocation step."""
    return -(-max(tokens, 0) // step) * step


def row_extent(
    prompt_tokens: int, max_tokens: int, decode_allowance: int, cached: int = 0
) -> RowExtent:
    """A row's extent: its prompt, the decode allowance it is counted for, its cached prefix."""
    return RowExtent(
        prompt_tokens, min(max_tokens, decode_allowance), max(0, min(cached, prompt_tokens - 1))
    )


def lone_capacity(extent: RowExtent, prefill_step_size: int) -> int:
    """Token slots a row's full-attention cache holds at its end when it runs alone.

    mlx-lm's growth replayed: the cached prefix as it is, the rest of the
    prompt but its last token in prefill chunks (cut at each checkpoint;
    each growth adds whole steps from the position where the cache ran out),
    then one token at a time up to ``extent.tokens``.
    """
    capacity = position = extent.cached
    end = extent.prompt - 1  # the first decode step feeds the last prompt token
    stops = [p for p in extent.cuts if position < p < end]
    for stop in [*stops, end]:
        while position < stop:
            n = min(prefill_step_size, stop - position)
            if position + n > capacity:
                capacity = position + stepped(n)
            position += n
    end = extent.tokens
    if end > capacity:
        capacity += stepped(end - capacity)
    return capacity


def shared_capacity(
    rows: Sequence[RowExtent], prefill_step_size: int, prompt_concurrency: int = 1
) -> int:
    """Token slots per row a shared batch holding ``rows`` may reach, whatever order they end in.

    The batch's position never passes its longest row's final length, or,
    while rows prefill at different positions, the longest prompt among
    them plus one chunk of the longest rest; the spare capacity stays below
    one step.
    """
    peak = max(r.tokens for r in rows)
    prefilling = [r for r in rows if r.prefilling]
    if _uneven(prefilling, prompt_concurrency):
        # A row that stops at a checkpoint while others take a whole chunk can
        # leave the batch a chunk ahead again: one more chunk per checkpoint.
        chunk = min(prefill_step_size, max(r.rest for r in prefilling))
        stops = 1 + sum(len(r.cuts) for r in prefilling)
        peak = max(peak, max(r.prompt for r in prefilling) + stops * chunk)
    return peak + KV_STEP - 1


def _uneven(prefilling: Sequence[RowExtent], prompt_concurrency: int) -> bool:
    """Whether rows prefilling together can stand at different positions.

    Rows that start in one prompt batch from prefixes of one length and
    stop nowhere on the way stay level (the longest rest sets the pace); any
    other mix can leave a row a chunk ahead of every row's own length.
    """
    if len(prefilling) < 2:
        return False
    level = (
        len({r.cached for r in prefilling}) == 1
        and not any(r.prefilled or r.cuts for r in prefilling)
        and len(prefilling) <= prompt_concurrency
    )
    return not level


def project_batch_bytes(
    layout: CacheLayout,
    rows: Sequence[RowExtent],
    prefill_step_size: int,
    *,
    lone: bool = False,
    prompt_concurrency: int = 1,
) -> int:
    """Projected KV bytes of a batch holding ``rows``.

    Every row pays for the batch's capacity (the batch caches share one),
    window layers cap at the window plus one prefill chunk, and state layers
    cost the same per row regardless of length. ``lone``: the batch is one
    row that joined an empty batch and has been alone since (projected
    exactly); otherwise the shared bound applies, with ``prompt_concurrency``
    prompts prefilled in one group.
    """
    if not rows:
        return 0
    n = len(rows)
    if lone and n == 1:
        capacity = lone_capacity(rows[0], prefill_step_size)
    else:
        capacity = shared_capacity(rows, prefill_step_size, prompt_concurrency)
    total = 0
    for layer in layout.layers:
        if layer.kind == "full":
            total += n * capacity * layer.bytes_per_token
        elif layer.kind == "window":
            total += n * min(capacity, layer.window + prefill_step_size) * layer.bytes_per_token
        else:
            total += n * layer.state_bytes
    return total


def alone_bytes(layout: CacheLayout, candidate: RowExtent, prefill_step_size: int) -> int:
    """The candidate's projected bytes in an otherwise empty batch."""
    return project_batch_bytes(layout, [candidate], prefill_step_size, lone=True)


Waiting = Literal["batch_full", "budget"]


@dataclass(frozen=True)
class Admission:
    """The answer for a candidate at the head of the pending queue."""

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
    prompt_concurrency: int = 1,
) -> Admission:
    """May ``candidate`` join the ``running`` rows now?

    It may when a slot is free, the real bytes of the batch are within the
    budget (they can outgrow the projection when rows run past the decode
    allowance: then admission stops, and no running row is ever dropped), and
    the projection of the batch with the candidate fits the budget.
    """
    projected = project_batch_bytes(
        layout,
        [*running, candidate],
        prefill_step_size,
        lone=not running,
        prompt_concurrency=prompt_concurrency,
    )
    if len(running) >= batch_size:
        return Admission(False, "batch_full", projected)
    if real_bytes > budget or projected > budget:
        return Admission(False, "budget", projected)
    return Admission(True, None, projected)


def never_fits(
    layout: CacheLayout, candidate: RowExtent, budget: int, prefill_step_size: int
) -> int | None:
    """The projected bytes if ``candidate`` alone exceeds ``budget``, else None."""
    alone = alone_bytes(layout, candidate, prefill_step_size)
    return alone if alone > budget else None


@dataclass(frozen=True)
class HitPlan:
    """What to do with a candidate's prompt-cache hit so that it can ever run.

    ``cached``: the prefix to keep (the hit, a shorter one ending on a step,
    or 0: none); ``refused``: the projected bytes when even no hit fits.
    """

    cached: int
    refused: int | None = None


def plan_hit(
    layout: CacheLayout,
    candidate: RowExtent,
    budget: int,
    prefill_step_size: int,
    *,
    trimmable: bool,
    cuts: Callable[[int], tuple[int, ...]] | None = None,
) -> HitPlan:
    """Keep the candidate's cached prefix when the row can fit alone with it; else re-plan.

    A prefix that does not end on a 256-token step makes the row's cache one
    step larger than the same row without it, so a hit can turn a request
    that fits into one that never does. Then the hit is cut back to the
    last step boundary (when the cache can be trimmed), else dropped; when
    not even the bare request fits, ``refused`` holds its projection.
    ``cuts(cached)``: where the prefill stops for checkpoints when the row
    starts from ``cached`` tokens (default: the candidate's own cuts).
    """

    def alone(cached: int) -> int:
        extent = replace(candidate, cached=cached)
        if cuts is not None:
            extent = replace(extent, cuts=cuts(cached))
        return alone_bytes(layout, extent, prefill_step_size)

    if alone(candidate.cached) <= budget:
        return HitPlan(candidate.cached)
    if trimmable and candidate.cached >= KV_STEP:
        cut = candidate.cached // KV_STEP * KV_STEP
        if alone(cut) <= budget:
            return HitPlan(cut)
    bare = alone(0)
    return HitPlan(0) if bare <= budget else HitPlan(0, refused=bare)


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
