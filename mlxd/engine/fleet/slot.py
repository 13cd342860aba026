"""One configured model in the fleet: its slot, a request's lease on it, its bytes.

Plain bookkeeping for the fleet (:mod:`mlxd.engine.fleet.fleet`), which owns
every decision; nothing here touches MLX. A slot lives on the event loop:
engine threads never read it (they get settings values through their
engine's commands).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from mlxd.config import Settings
from mlxd.config.entry import ModelEntry
from mlxd.engine.policy.admission import headroom_bytes

if TYPE_CHECKING:
    from mlxd.engine.model_engine import AnyEngine, EngineInfo, ModelEngine

# The demo model's weights before it is converted (float32, the largest).
_DEMO_ESTIMATE = 540 * 1024**2

# A lease's engine: the chat Engine or the EmbeddingEngine, as the route asked.
E = TypeVar("E", bound="AnyEngine", covariant=True)
# Its info record, read through the lease.
InfoT = TypeVar("InfoT", bound="EngineInfo")


def budget_bytes(settings: Settings, device_bytes: int) -> int:
    """``[memory] budget`` in bytes: as written, or device memory less a headroom."""
    budget = settings.memory.budget
    if budget == "auto":
        return max(device_bytes - headroom_bytes(device_bytes), 64 * 1024**2)
    return int(budget)


def estimate_weights(entry: ModelEntry) -> int:
    """The weights' bytes before loading: the size of the safetensors files."""
    if entry.repo is not None:
        from mlxd.hub import repo_dir

        found = repo_dir(entry.repo, entry.repo_revision)
        return _files_bytes(found) if found is not None else 0
    if entry.path is None and entry.kind == "embedding":
        from mlxd.demo.embedding import ESTIMATED_BYTES, demo_embedding_dir

        return _files_bytes(demo_embedding_dir()) or ESTIMATED_BYTES
    if entry.path is None:
        from mlxd import demo

        for dtype in ("float32", "bfloat16", "q4"):
            found = _files_bytes(demo.demo_model_dir(dtype))
            if found and entry.demo_dtype in ("auto", dtype):
                return found
        return _DEMO_ESTIMATE
    return _files_bytes(Path(entry.path).expanduser())


def _files_bytes(directory: Path) -> int:
    try:
        return sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    except OSError:
        return 0


class Slot:
    """One configured model: its entry, its engine (for the entry's life), where it stands."""

    def __init__(self, model_id: str, entry: ModelEntry, settings: Settings, engine: AnyEngine):
        self.id = model_id
        self.entry = entry
        self.settings = settings  # what this model runs with (for_model)
        self.engine = engine
        self.state = "unloaded"
        self.error: str | None = None
        self.failed_at = 0.0
        self.active = 0  # leases held: requests between routing and their last byte
        self.waiting = 0  # requests waiting for the load
        self.wait_reason: str | None = None
        self.last_used: float | None = None
        self.loaded_at: float | None = None
        self.load_seconds: float | None = None
        self.pin_override: bool | None = None
        self.task: asyncio.Future[None] | None = None
        self.removed = False

    @property
    def pinned(self) -> bool:
        return self.entry.pin if self.pin_override is None else self.pin_override

    @property
    def busy(self) -> bool:
        """Requests hold it, or its engine has work."""
        return self.active > 0 or self.engine.busy

    def prompt_cache_cap(self) -> int:
        """The prompt cache's byte cap, reserved with the weights (chat models have one)."""
        return self.settings.prompt_cache.max_bytes if self.entry.kind == "chat" else 0


class Lease(Generic[E]):
    """A request's hold on a loaded model; :meth:`release` when its last byte is sent.

    ``Fleet.acquire(name, "chat")`` lends a ``Lease[Engine]``, ``"embedding"``
    a ``Lease[EmbeddingEngine]``: the route that asked for a kind gets that
    kind's engine to submit to.
    """

    def __init__(self, slot: Slot, engine: E, on_release: Callable[[Slot], None]):
        self._on_release = on_release
        self._slot = slot
        self._engine = engine
        self.id = slot.id
        self.settings = slot.settings
        self._released = False

    @property
    def engine(self) -> E:
        return self._engine

    @property
    def info(self: Lease[ModelEngine[InfoT]]) -> InfoT | None:
        """The model's ModelInfo (chat) or EmbeddingInfo (embedding)."""
        return self._engine.info

    def on_release(self, callback: Callable[[], None]) -> None:
        """Also call ``callback`` when the lease is released (a key's quota ticket)."""
        before = self._on_release

        def both(slot: Slot) -> None:
            try:
                callback()
            finally:
                before(slot)

        self._on_release = both

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._on_release(self._slot)


def swallow_failure(task: asyncio.Future[None]) -> None:
    """A background load's failure is reported to its waiters, and as an event."""
    if not task.cancelled():
        task.exception()
