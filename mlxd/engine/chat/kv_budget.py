"""The KV budget side of the engine core: the room in effect, the bytes held and projected.

:class:`KvBudget` is a part of :class:`~mlxd.engine.chat.core.EngineCore`
(its base class), kept in its own module: the budget in effect for the
served model and the config key that sets it (:mod:`mlxd.engine.policy.budget`),
the real and projected KV bytes, the claim on a shared memory pool, and the
queued requests refused when the budget no longer holds them
(docs/batching.md, "Admission never wedges"). Engine thread only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from mlxd.config import Settings
from mlxd.engine.chat.counters import Counters
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.row import Row
from mlxd.engine.memory import MemoryPool
from mlxd.engine.messages import ErrorCode
from mlxd.engine.policy import admission
from mlxd.engine.policy.budget import KvRoom, PoolRoom, config_key, kv_room

if TYPE_CHECKING:
    from mlxd.engine.chat.batch import BatchLane
    from mlxd.engine.chat.serial import SerialRun


class KvBudget:
    """The KV budget methods of the engine core; the attributes are the core's."""

    settings: Settings
    pool: MemoryPool | None
    pool_id: str
    loaded: LoadedModel | None
    batch: BatchLane | None
    serial: SerialRun | None
    pending: deque[Row]
    serial_queue: deque[Row]
    counters: Counters
    room: KvRoom
    max_kv_seen: int

    def fail(
        self, row: Row, message: str, *, code: ErrorCode = "generation_error", status: int = 500
    ) -> None:
        raise NotImplementedError

    def cuts(self, row: Row, cached: int) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def budget_bytes(self) -> int:
        """The KV bytes this model's rows may ever hold (``room``'s size)."""
        return self.room.bytes

    def live_bytes(self) -> int:
        """Real KV bytes the batch holds now."""
        return self.batch.nbytes if self.batch is not None else 0

    def kv_bytes(self) -> int:
        """Real KV bytes of both lanes now."""
        return self.live_bytes() + (self.serial.nbytes if self.serial is not None else 0)

    def note_kv(self, *, after_step: bool) -> None:
        """Record the KV bytes held now (after an admission or a step): the peak, and
        steps that ended over the budget (rows generating past their decode allowance)."""
        kv = self.kv_bytes()
        self.max_kv_seen = max(self.max_kv_seen, kv)
        if after_step and kv > self.budget_bytes:
            self.counters.kv_over_budget_steps += 1

    def batch_projection(self) -> int:
        """The projected KV bytes of the rows in the batch now."""
        if self.batch is None or self.loaded is None or not len(self.batch):
            return 0
        return admission.project_batch_bytes(
            self.loaded.layout,
            [r.projected() for r in self.batch.rows.values()],
            self.settings.batch.prefill_step_size,
            lone=self.batch.lone,
            prompt_concurrency=self.settings.batch.prompt_concurrency,
        )

    def kv_claim(self, candidate: int | None = None) -> int:
        """The KV bytes this engine holds or may grow to: its claim on a shared pool."""
        serial = self.serial.nbytes if self.serial is not None else 0
        if candidate is not None:
            return candidate + serial
        return max(self.batch_projection(), self.live_bytes()) + serial

    def admission_budget(self) -> int:
        """The KV bytes the batch may use now: the budget, less what other models claim."""
        if self.pool is None:
            return self.budget_bytes
        serial = self.serial.nbytes if self.serial is not None else 0
        return min(self.budget_bytes, self.pool.kv_limit(self.pool_id) - serial)

    def update_room(self, *, recheck: bool = False) -> None:
        """Recompute the KV budget in effect; when it shrank (or ``recheck``: the
        projections changed), refuse the queued requests that can no longer fit."""
        before = self.room.bytes
        self.room = self._room()
        if recheck or self.room.bytes < before:
            self.refuse_unfittable()

    def _room(self) -> KvRoom:
        s = self.settings
        keys = config_key(s, "batch", "kv_budget"), config_key(s, "prompt_cache", "max_bytes")
        cap = s.prompt_cache.max_bytes
        if self.pool is not None:
            pool = PoolRoom(self.pool.budget, self.pool.reserved(), cap)
            return kv_room(s.batch.kv_budget, auto_bytes=0, pool=pool, keys=keys)
        auto = 0
        if s.batch.kv_budget == "auto":
            from mlxd.engine.chat.loading import device_memory_bytes

            weights = self.loaded.weights_bytes if self.loaded else 0
            auto = admission.auto_budget(device_memory_bytes(), weights, cap)
        return kv_room(s.batch.kv_budget, auto_bytes=auto, pool=None, keys=keys)

    def refuse_unfittable(self) -> None:
        """Refuse every queued request that cannot fit the budget even alone and uncached."""
        if self.loaded is None:
            return
        layout, step = self.loaded.layout, self.settings.batch.prefill_step_size
        for queue in (self.pending, self.serial_queue):
            for row in list(queue):
                bare = replace(row.extent, cached=0, cuts=self.cuts(row, 0))
                needed = admission.alone_bytes(layout, bare, step)
                if needed > self.budget_bytes:
                    queue.remove(row)
                    self.refuse_over_budget(row, needed)

    def refuse_over_budget(self, row: Row, needed: int) -> None:
        """End a queued ``row`` that can never fit: the documented 400, naming the key."""
        what = f"This request ({len(row.prompt)} prompt tokens + {row.extent.decode} to generate)"
        message = f"The KV budget changed while this request waited: {self.room.over(needed, what)}"
        self.fail(row, message, code="context_over_budget", status=400)
