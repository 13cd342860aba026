"""One configured model in the fleet: its slot, a request's lease on it, its bytes.

Plain bookkeeping for :mod:`mlxd.engine.fleet.fleet`, which owns every decision;
nothing here touches MLX.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from mlxd.config import Settings
from mlxd.config.entry import ModelEntry
from mlxd.engine.fleet.memory import PoolView
from mlxd.engine.fleet.values import ModelState
from mlxd.engine.policy.admission import headroom_bytes

# The demo model's weights before it is converted (float32, the largest).
_DEMO_ESTIMATE = 540 * 1024**2


def budget_bytes(settings: Settings, device_bytes: int) -> int:
    """``[memory] budget`` in bytes: as written, or device memory less a headroom."""
    budget = settings.memory.budget
    if budget == "auto":
        return max(device_bytes - headroom_bytes(device_bytes), 64 * 1024**2)
    return int(budget)


def estimate_weights(entry: ModelEntry) -> int:
    """The weights' bytes before loading: the size of the safetensors files."""
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
    """One configured model: its entry, its engine, where it stands."""

    def __init__(self, model_id: str, entry: ModelEntry, settings: Settings):
        self.id = model_id
        self.entry = entry
        self.settings = settings  # what this model runs with (for_model)
        self.engine: Any = None
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
        self.task: asyncio.Future | None = None
        self.removed = False

    @property
    def pinned(self) -> bool:
        return self.entry.pin if self.pin_override is None else self.pin_override

    @property
    def busy(self) -> bool:
        """Requests hold it, or its engine has work."""
        return self.active > 0 or (self.engine is not None and self.engine.busy)

    def prompt_cache_cap(self) -> int:
        return self.settings.prompt_cache.max_bytes if self.entry.kind == "chat" else 0


class Lease:
    """A request's hold on a loaded model; :meth:`release` when its last byte is sent."""

    def __init__(self, slot: Slot, on_release: Callable[[Slot], None]):
        self._on_release = on_release
        self._slot = slot
        self.id = slot.id
        self.engine = slot.engine
        self.settings = slot.settings
        self._released = False

    @property
    def info(self) -> Any:
        """The model's ModelInfo (chat) or EmbeddingInfo (embedding)."""
        engine = self.engine
        return getattr(engine, "model_info", None) or getattr(engine, "info", None)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._on_release(self._slot)


def model_state(slot: Slot, pool: PoolView, default: bool) -> ModelState:
    """What ``slot`` looks like from outside (``/v1/models``, ``/stats``, the dashboard)."""
    held = next((e for e in pool.entries if e.model_id == slot.id), None)
    cap = slot.prompt_cache_cap() if held else 0
    info = None
    engine: dict[str, Any] = {}
    prompt_cache = 0
    if slot.engine is not None and slot.state == "loaded":
        if slot.entry.kind == "chat":
            info = slot.engine.model_info
            snap = slot.engine.snapshot()
            prompt_cache = snap.prompt_cache.bytes
            engine = {
                "rows": len(snap.rows),
                "pending": len(snap.pending),
                "kv_bytes": snap.batch.kv_bytes,
                "kv_budget_bytes": snap.batch.kv_budget_bytes,
                "tokens_per_s": snap.throughput.get("last_minute_tps", 0.0),
                "counters": {
                    k: v
                    for k, v in snap.counters.items()
                    if isinstance(v, int) and not isinstance(v, bool)
                },
            }
        else:
            info = slot.engine.info
            engine = _plain(slot.engine.snapshot())
    return ModelState(
        id=slot.id,
        kind=slot.entry.kind,
        path=slot.entry.path,
        aliases=tuple(slot.entry.aliases),
        state=slot.state,
        default=default,
        pinned=slot.pinned,
        keep_alive=slot.entry.keep_alive,
        weights_bytes=(held.fixed - cap) if held else 0,
        reserved_bytes=held.fixed if held else 0,
        kv_bytes=held.kv if held else 0,
        prompt_cache_bytes=prompt_cache,
        active=slot.active,
        waiting=slot.waiting,
        wait_reason=slot.wait_reason,
        last_used=slot.last_used,
        loaded_at=slot.loaded_at,
        load_seconds=slot.load_seconds,
        error=slot.error,
        capabilities=_capabilities(info),
        engine=engine,
    )


def _plain(value: Any) -> dict[str, Any]:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return dict(value) if isinstance(value, dict) else {}


def _capabilities(info: Any) -> dict[str, Any]:
    if info is None:
        return {}
    keys = (
        "context_length",
        "family",
        "dtype",
        "tool_format",
        "reasoning",
        "structured_output",
        "batchable",
        "vocab_size",
        "max_token_chars",
        "dimensions",
        "supports_dimensions",
    )
    out = {k: getattr(info, k) for k in keys if hasattr(info, k)}
    if "tool_format" in out:
        out["tools"] = out["tool_format"] is not None
    return out


def swallow_failure(task: asyncio.Future) -> None:
    """A background load's failure is reported to its waiters, and as an event."""
    if not task.cancelled():
        task.exception()
