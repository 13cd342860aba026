"""The lanes as the scheduler reads them: :class:`~mlxd.engine.chat.step_plan.Lanes` over a core.

The MLX side of scheduling, engine thread only: the rows each lane runs and
their real bytes, the prompt-cache lookup of a queued row, and a hit cut
back to fewer tokens when the whole hit would keep the row from ever
fitting the budget (docs/batching.md, "Admission never wedges").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, cast

from mlx_lm.models.cache import can_trim_prompt_cache

from mlxd.config import Settings
from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.kv_caches import cut_prefix
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.prompt_cache import Fetched, PromptCache
from mlxd.engine.chat.row import Hit, Row
from mlxd.engine.chat.serial import SerialRun
from mlxd.engine.messages import ErrorCode
from mlxd.engine.policy import admission
from mlxd.engine.policy.admission import CacheLayout


class Core(Protocol):
    """What the lanes are read from (:class:`~mlxd.engine.chat.core.EngineCore`)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def loaded(self) -> LoadedModel | None: ...
    @property
    def batch(self) -> BatchLane | None: ...
    @property
    def serial(self) -> SerialRun | None: ...
    @property
    def hooks(self) -> Any: ...
    @property
    def prompt_cache(self) -> PromptCache: ...

    def live_bytes(self) -> int: ...
    def fetch_cache(self, prompt: list[int]) -> Fetched: ...
    def cuts(self, row: Row, cached: int) -> tuple[int, ...]: ...
    def fail(self, row: Row, message: str, *, code: ErrorCode = ..., status: int = ...) -> None: ...


class EngineLanes:
    """Reads ``core``'s lanes and prompt cache for its scheduler."""

    def __init__(self, core: Core):
        self.core = core

    def layout(self) -> CacheLayout | None:
        loaded = self.core.loaded
        return loaded.layout if loaded is not None else None

    def batch_rows(self) -> Sequence[Row]:
        batch = self.core.batch
        return list(batch.rows.values()) if batch is not None else []

    def batch_lone(self) -> bool:
        batch = self.core.batch
        return batch is not None and batch.lone

    def batch_bytes(self) -> int:
        return self.core.live_bytes()

    def serial_row(self) -> Row | None:
        serial = self.core.serial
        return serial.row if serial is not None else None

    def serial_bytes(self) -> int:
        serial = self.core.serial
        return serial.nbytes if serial is not None else 0

    def rewindable(self) -> bool:
        loaded = self.core.loaded
        return loaded is not None and loaded.rewindable

    def preemption(self) -> bool:
        return getattr(self.core.hooks, "preemption", False)

    def auto_budget(self) -> int:
        from mlxd.engine.chat.loading import device_memory_bytes

        core = self.core
        weights = core.loaded.weights_bytes if core.loaded else 0
        cap = core.settings.prompt_cache.max_bytes
        return admission.auto_budget(device_memory_bytes(), weights, cap)

    def fetch(self, row: Row) -> Hit:
        return self.core.fetch_cache(row.prompt)

    def trimmable(self, hit: Hit) -> bool:
        return can_trim_prompt_cache(hit.cache)

    def cut(self, row: Row, hit: Hit, cached: int) -> Hit:
        fetched = cast(Fetched, hit)
        had = len(row.prompt) - len(fetched.rest)
        self.core.prompt_cache.not_used(fetched.source, had - cached, dropped=not cached)
        cache, rest = cut_prefix(fetched.cache, row.prompt, fetched.rest, cached)
        source = fetched.source if cache is not None else "none"
        return replace(fetched, cache=cache, rest=rest, source=source)

    def cuts(self, row: Row, cached: int) -> tuple[int, ...]:
        return self.core.cuts(row, cached)

    def fail(self, row: Row, message: str, *, code: ErrorCode, status: int) -> None:
        self.core.fail(row, message, code=code, status=status)
