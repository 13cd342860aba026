"""The KV budget of one engine: the room in effect, the bytes projected, the claim on a shared pool.

:class:`KvBudget` is owned by the :class:`~mlxd.engine.chat.scheduler.Scheduler`:
the budget in effect for the served model and the config key that sets it
(:mod:`mlxd.engine.policy.budget`), the projected KV bytes of the batch, and
this engine's claim on the memory pool shared with other models
(:mod:`mlxd.engine.memory`). It reads the lanes through
:class:`~mlxd.engine.chat.step_plan.Lanes` and imports no MLX. Engine thread only.
"""

from __future__ import annotations

from mlxd.config import Settings
from mlxd.engine.chat.step_plan import Lanes
from mlxd.engine.memory import MemoryPool
from mlxd.engine.policy import admission
from mlxd.engine.policy.budget import KvRoom, PoolRoom, config_key, kv_room


class KvBudget:
    """The room in effect and the pool claim.

    Args:
        pool: The memory budget shared with other loaded models; None: this
            engine's ``[batch] kv_budget`` alone. ``pool_id`` names this engine in it.
    """

    def __init__(self, pool: MemoryPool | None = None, pool_id: str = ""):
        self.pool = pool
        self.pool_id = pool_id
        self.room = KvRoom(0, "kv_budget")

    @property
    def bytes(self) -> int:
        """The KV bytes this model's rows may ever hold (``room``'s size)."""
        return self.room.bytes

    def batch_projection(self, lanes: Lanes, settings: Settings) -> int:
        """The projected KV bytes of the rows in the batch now."""
        layout, rows = lanes.layout(), lanes.batch_rows()
        if layout is None or not rows:
            return 0
        return admission.project_batch_bytes(
            layout,
            [r.projected() for r in rows],
            settings.batch.prefill_step_size,
            lone=lanes.batch_lone(),
            prompt_concurrency=settings.batch.prompt_concurrency,
        )

    def claim(self, lanes: Lanes, settings: Settings) -> int:
        """The KV bytes this engine holds or may grow to: its claim on a shared pool."""
        batch = max(self.batch_projection(lanes, settings), lanes.batch_bytes())
        return batch + lanes.serial_bytes()

    def admission_budget(self, serial_bytes: int) -> int:
        """The KV bytes the batch may use now: the budget, less what other models claim."""
        if self.pool is None:
            return self.bytes
        return min(self.bytes, self.pool.kv_limit(self.pool_id) - serial_bytes)

    def claim_kv(self, claim: int) -> bool:
        """Raise this engine's claim on the shared pool to ``claim`` bytes (True without a pool)."""
        return self.pool is None or self.pool.claim_kv(self.pool_id, claim)

    def report(self, claim: int) -> None:
        """Tell the shared pool the bytes this engine holds or may grow to now."""
        if self.pool is not None:
            self.pool.report_kv(self.pool_id, claim)

    def recompute(self, settings: Settings, lanes: Lanes) -> bool:
        """Recompute the room in effect; True when it shrank."""
        before = self.room.bytes
        self.room = self._room(settings, lanes)
        return self.room.bytes < before

    def _room(self, s: Settings, lanes: Lanes) -> KvRoom:
        keys = config_key(s, "batch", "kv_budget"), config_key(s, "prompt_cache", "max_bytes")
        cap = s.prompt_cache.max_bytes
        if self.pool is not None:
            pool = PoolRoom(self.pool.budget, self.pool.reserved(), cap)
            return kv_room(s.batch.kv_budget, auto_bytes=0, pool=pool, keys=keys)
        auto = lanes.auto_budget() if s.batch.kv_budget == "auto" else 0
        return kv_room(s.batch.kv_budget, auto_bytes=auto, pool=None, keys=keys)
