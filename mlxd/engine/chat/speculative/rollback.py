"""Which batch caches can drop a verify step's rejected positions per row, and how.

A verify step feeds every row ``width`` positions in one forward (its pending
token, its draft, right padding); afterwards row ``i`` keeps its first
``kept[i]`` positions (at least 1). Around that forward::

    if can_roll_back(model, caches):
        with begin(model, caches, width) as step:
            logits = model(inputs, cache=caches)
        ...  # acceptance
        step.commit(kept)

Per cache family (``CacheList`` parts each their own way):

- ``BatchKVCache`` and mlxd's ``BatchQuantKVCache`` (``kv_bits``): the count
  every row drops by ``trim``, the rest per row by the right-padding roll
  (``prepare(right_padding)`` + ``finalize()``), which moves a row's dropped
  positions into its left padding, which attention masks. Nothing is zeroed.
- ``BatchRotatingKVCache`` (sliding window): a rotated buffer is put in
  temporal order before the forward (its multi-token update does that itself,
  but its mask would be built for the rotated layout); the forward appends
  after the window's last ``max_size - 1`` keys, so every kept position
  still has its whole window. Then the same trim and roll as above, and the
  buffer is cut to the cursor: mlx-lm's ``trim`` only moves the cursor, and
  the next one-token update treats the whole buffer as the window, which
  would expose the dropped keys. A one-position step (a verify without
  drafts) drops nothing and is left as its update left it: it may have
  wrapped the buffer in place, its cursor short of the end.
- ``ArraysCache`` of the recurrent layers of Qwen3-Next and Qwen3.5
  (gated delta) and Mamba-2 and Falcon-H1 (SSM): a state cannot drop
  positions, so the forward records every position's state and the commit
  keeps, per row, the one after its last kept position. During the forward
  the layer's recurrence (``gated_delta_update`` / ``ssm_update``, looked up
  by name in the model's module) runs one position at a time, as a plain
  decode step does, keeping each state; its causal convolution's input
  (previous window + this step's inputs) is recorded by its ``Conv1d``, and a
  row's next window is the slice after its kept positions. Costs ``width``
  recurrent states per layer and row until the commit, and one small kernel
  call per position instead of one per step. Other recurrent families (and
  any cache not named here) do not roll back: their batches run at depth 0.

The recording hooks are installed on the model the first time (the family's
module-level recurrence function is wrapped; the model's ``Conv1d`` layers get
a subclass); outside a recording they only call through. mlx-lm has no hook
for per-position states (upstream gap, docs/batching.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    dynamic_roll,
)

from mlxd.engine.chat.quant_cache import BatchQuantKVCache

# mlx-lm module of a recurrent family -> the recurrence its layers call by name.
RECURRENT_FAMILIES = {
    "mlx_lm.models.qwen3_next": "gated_delta_update",
    "mlx_lm.models.qwen3_5": "gated_delta_update",
    "mlx_lm.models.mamba2": "ssm_update",
    "mlx_lm.models.falcon_h1": "ssm_update",
}
# The recurrence's arguments that have a time axis (axis 1).
_TIMED = {
    "gated_delta_update": ("q", "k", "v", "a", "b", "mask"),
    "ssm_update": ("hidden_states", "B", "C", "dt", "mask"),
}
_MARK = "_mlxd_rollback_families"
_local = threading.local()
_install_lock = threading.Lock()


class _Recording:
    """What one forward's recurrent layers did, in call order."""

    def __init__(self) -> None:
        self.conv_inputs: list[mx.array] = []
        # (state before, the state after each position)
        self.states: list[tuple[Any, list[mx.array]]] = []


def _recording() -> _Recording | None:
    return getattr(_local, "recording", None)


class _RecordingConv1d(nn.Conv1d):
    """A ``Conv1d`` that records its input while a verify forward records."""

    def __call__(self, x: mx.array) -> mx.array:
        recording = _recording()
        if recording is not None:
            recording.conv_inputs.append(x)
        return super().__call__(x)


def _stepwise(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``original``, run one position at a time (states kept) while recording."""
    signature = inspect.signature(original)
    timed = _TIMED[name]

    @functools.wraps(original)
    def recurrence(*args: Any, **kwargs: Any) -> Any:
        recording = _recording()
        if recording is None:
            return original(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        if given.get("lengths") is not None:
            raise RuntimeError("a verify forward has no per-row lengths")
        before = state = given.get("state")
        ys, states = [], []
        for t in range(given[timed[0]].shape[1]):
            step = dict(given)
            for key in timed:
                if step.get(key) is not None:
                    step[key] = step[key][:, t : t + 1]
            step["state"] = state
            y, state = original(**step)
            ys.append(y)
            states.append(state)
        recording.states.append((before, states))
        return mx.concatenate(ys, axis=1), state

    recurrence.__dict__["_mlxd_original"] = original
    return recurrence


def _families(model: Any) -> frozenset[str]:
    """The recurrent families whose layers ``model`` has, hooks installed (once)."""
    found = getattr(model, _MARK, None)
    if found is not None:
        return found
    with _install_lock:
        # Not an mlx-lm model (a vision model's language model through mlx-vlm): none.
        named = getattr(model, "named_modules", None)
        modules = [m for _, m in named()] if isinstance(model, nn.Module) and named else []
        names = frozenset(
            type(m).__module__ for m in modules if type(m).__module__ in RECURRENT_FAMILIES
        )
        for family in names:
            module = sys.modules[family]
            fn = RECURRENT_FAMILIES[family]
            current = getattr(module, fn)
            if "_mlxd_original" not in current.__dict__:
                setattr(module, fn, _stepwise(current, fn))
        if names:
            for m in modules:
                if type(m) is nn.Conv1d:
                    m.__class__ = _RecordingConv1d
        with contextlib.suppress(AttributeError, TypeError):
            object.__setattr__(model, _MARK, names)
    return names


def leaves(caches: list[Any]) -> Iterator[Any]:
    """Every layer cache, ``CacheList`` parts in order."""
    for cache in caches:
        if isinstance(cache, CacheList):
            yield from leaves(list(cache.caches))
        else:
            yield cache


def _kv(cache: Any) -> bool:
    return type(cache) is BatchKVCache or isinstance(cache, BatchQuantKVCache)


def can_roll_back(model: Any, caches: list[Any]) -> bool:
    """Whether every layer cache of the batch can keep a per-row prefix of a verify step."""
    if not caches:
        return False
    recurrent = None
    for cache in leaves(caches):
        if _kv(cache):
            continue
        if type(cache) is BatchRotatingKVCache:
            if cache.keys is None or cache._lengths is not None:
                return False
            continue
        if type(cache) is not ArraysCache:
            return False
        if recurrent is None:
            recurrent = bool(_families(model))
        if (
            not recurrent
            or len(cache.cache) != 2
            or any(a is None for a in cache.cache)
            or cache.lengths is not None
        ):
            return False
    return True


def begin(model: Any, caches: list[Any], width: int) -> Transaction:
    """Start a verify step of ``width`` positions over ``caches`` (see the module doc)."""
    if any(type(c) is ArraysCache for c in leaves(caches)):
        _families(model)
    return Transaction(caches, width)


class Transaction:
    """One verify step's caches: record during the forward (``with``), then :meth:`commit`."""

    def __init__(self, caches: list[Any], width: int):
        self.width = width
        self._leaves = list(leaves(caches))
        self._arrays = [c for c in self._leaves if type(c) is ArraysCache]
        self._before = [list(c.cache) for c in self._arrays]
        self._recording = _Recording()
        for cache in self._leaves:
            if type(cache) is BatchRotatingKVCache and cache.rotated:
                cache._temporal_order()

    def __enter__(self) -> Transaction:
        if self._arrays:
            _local.recording = self._recording
        return self

    def __exit__(self, *exc: object) -> None:
        _local.recording = None

    def commit(self, kept: list[int]) -> None:
        """Keep the first ``kept[i]`` positions of row ``i`` (1 to ``width``) in every cache."""
        if not all(1 <= k <= self.width for k in kept):
            raise ValueError(f"kept {kept} outside 1..{self.width}")
        surplus = [self.width - k for k in kept]
        common = min(surplus)
        extra = [s - common for s in surplus]
        for cache in self._leaves:
            if _kv(cache):
                if common:
                    cache.trim(common)
                if any(extra):
                    cache.prepare(right_padding=extra)
                    cache.finalize()
            elif type(cache) is BatchRotatingKVCache:
                _drop_rotating(cache, common, extra)
        if self._arrays:
            self._commit_recurrent(kept)

    def _commit_recurrent(self, kept: list[int]) -> None:
        recording = self._recording
        if not (len(recording.conv_inputs) == len(recording.states) == len(self._arrays)):
            raise RuntimeError(
                f"verify forward recorded {len(recording.conv_inputs)} convolutions and "
                f"{len(recording.states)} recurrences for {len(self._arrays)} recurrent caches"
            )
        width = self.width
        uniform = len(set(kept)) == 1
        at = mx.array(kept)
        for cache, before, conv_input, (initial, states) in zip(
            self._arrays, self._before, recording.conv_inputs, recording.states, strict=True
        ):
            n_keep = conv_input.shape[1] - width
            window = cache.cache[0]
            if (
                initial is not before[1]
                or cache.cache[1] is not states[-1]
                or len(states) != width
                or window is None
                or window.shape[1] != n_keep
            ):
                raise RuntimeError("a recurrent layer's verify forward was not recorded in order")
            if cache.left_padding is not None:
                cache.left_padding = cache.left_padding + (width - at)
            if all(k == width for k in kept):
                continue
            if uniform:
                cache.cache[1] = states[kept[0] - 1]
                cache.cache[0] = mx.contiguous(conv_input[:, kept[0] : kept[0] + n_keep])
                continue
            rows = mx.arange(len(kept))
            cache.cache[1] = mx.stack(states)[at - 1, rows]
            positions = (at[:, None] + mx.arange(n_keep))[..., None]
            cache.cache[0] = mx.take_along_axis(conv_input, positions, axis=1)


def _drop_rotating(cache: BatchRotatingKVCache, common: int, extra: list[int]) -> None:
    """Drop a sliding-window cache's last ``common + extra[i]`` positions of row ``i``."""
    if not common and not any(extra):
        # Nothing to drop. A one-position step (a verify without drafts) may have wrapped
        # the buffer in place: its cursor is then not its end, and cutting there would
        # lose the window.
        return
    if common:
        cache.trim(common)
    keys, values = cache.keys, cache.values
    assert keys is not None and values is not None  # can_roll_back: the window holds keys
    keys, values = keys[..., : cache._idx, :], values[..., : cache._idx, :]
    if any(extra):
        shift = mx.array(extra)
        keys = dynamic_roll(keys, shift[:, None], axis=2)
        values = dynamic_roll(values, shift[:, None], axis=2)
        cache.left_padding = cache.left_padding + shift
        cache.offset = cache.offset - shift
    cache.keys, cache.values = keys, values
