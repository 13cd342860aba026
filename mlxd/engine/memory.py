"""One memory budget shared by every loaded model.

``[memory] budget`` covers the weights, KV caches and prompt caches of all
loaded models. The pool keeps, per model:

- a *fixed* reservation: its weights (estimated from the files before the
  load, measured after it) plus its prompt cache's byte cap; taken before a
  load starts, so two loads never overbook;
- a *KV claim*: the bytes its batch may grow to (the admission projection,
  or the real bytes when rows have outgrown it). A model admits a row only
  by raising its claim, atomically, within what the others leave.

Every method is thread-safe: each model's engine thread claims KV, the
event loop reserves and releases for loads. Nothing here touches MLX.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolEntry:
    model_id: str
    fixed: int
    kv: int


@dataclass(frozen=True)
class PoolUsage:
    budget: int
    used: int
    entries: tuple[PoolEntry, ...]

    @property
    def free(self) -> int:
        return max(0, self.budget - self.used)


class MemoryPool:
    """The byte budget and who holds what of it (see the module docstring)."""

    def __init__(self, budget: int):
        self._lock = threading.Lock()
        self._budget = budget
        self._fixed: dict[str, int] = {}
        self._kv: dict[str, int] = {}

    @property
    def budget(self) -> int:
        return self._budget

    def set_budget(self, budget: int) -> None:
        """A reloaded budget: nothing is taken back, new claims see the new size."""
        with self._lock:
            self._budget = budget

    def reserve(self, model_id: str, nbytes: int) -> bool:
        """Reserve ``nbytes`` fixed for ``model_id`` if they fit now; True when they did."""
        with self._lock:
            others = self._used() - self._fixed.get(model_id, 0)
            if others + nbytes > self._budget:
                return False
            self._fixed[model_id] = nbytes
            return True

    def settle(self, model_id: str, nbytes: int) -> None:
        """Replace an estimate with what the load measured (it may exceed the budget)."""
        with self._lock:
            self._fixed[model_id] = nbytes

    def release(self, model_id: str) -> None:
        """Everything ``model_id`` held is free again (it was unloaded)."""
        with self._lock:
            self._fixed.pop(model_id, None)
            self._kv.pop(model_id, None)

    def rename(self, old_id: str, new_id: str) -> None:
        with self._lock:
            if old_id in self._fixed:
                self._fixed[new_id] = self._fixed.pop(old_id)
            if old_id in self._kv:
                self._kv[new_id] = self._kv.pop(old_id)

    def reserved(self) -> int:
        """The fixed reservations of every loaded model: weights and prompt-cache caps."""
        with self._lock:
            return sum(self._fixed.values())

    def kv_ceiling(self, model_id: str) -> int:
        """The most KV ``model_id`` could ever claim with today's loaded models."""
        with self._lock:
            return max(0, self._budget - sum(self._fixed.values()))

    def kv_limit(self, model_id: str) -> int:
        """The KV bytes ``model_id`` may claim now: what the others leave."""
        with self._lock:
            return max(0, self._budget - self._used() + self._kv.get(model_id, 0))

    def claim_kv(self, model_id: str, nbytes: int) -> bool:
        """Raise ``model_id``'s KV claim to ``nbytes`` if that fits; True when it did."""
        with self._lock:
            if model_id not in self._fixed:  # not (or no longer) loaded under this id
                return False
            if self._used() - self._kv.get(model_id, 0) + nbytes > self._budget:
                return False
            self._kv[model_id] = nbytes
            return True

    def report_kv(self, model_id: str, nbytes: int) -> None:
        """Set the claim to what the batch holds or may grow to now (rows ended or grew)."""
        with self._lock:
            if model_id in self._fixed:
                self._kv[model_id] = nbytes

    def usage(self) -> PoolUsage:
        with self._lock:
            entries = tuple(
                PoolEntry(i, fixed, self._kv.get(i, 0)) for i, fixed in self._fixed.items()
            )
            return PoolUsage(self._budget, self._used(), entries)

    def _used(self) -> int:
        return sum(self._fixed.values()) + sum(self._kv.values())
