"""What the fleet of models looks like from outside: plain frozen values.

The fleet (:mod:`mlxd.engine.fleet.fleet`) runs on the event loop and owns one
slot per configured model; readers (``/v1/models``, ``/stats``, ``/metrics``,
the dashboard) take :class:`FleetStatus`, rebuilt on demand, and never touch
the slots. :class:`FleetRefusal` carries a request's refusal (unknown model,
wrong kind, a load that failed, a model that can never fit) as the engine's
:class:`~mlxd.engine.messages.Failed`, so every API renders it in its shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mlxd.engine.messages import Failed

# A slot's states: unloaded -> loading -> loaded -> unloading -> unloaded;
# a load that fails leaves it "failed" (the next request tries again).
STATES = ("unloaded", "loading", "loaded", "unloading", "failed")


class FleetRefusal(Exception):
    """A request the fleet cannot serve; ``failed`` says why, with the status."""

    def __init__(self, failed: Failed):
        super().__init__(failed.message)
        self.failed = failed


@dataclass(frozen=True)
class FleetApplied:
    """What a reload did to the fleet, beyond the changes that simply took effect.

    ``failed``: model id -> why its swap failed (the previous model serves);
    ``kept``: model id -> a live change it could not take, and what it keeps;
    ``evicted``: idle unpinned models unloaded to fit a lowered ``[memory] budget``;
    ``over_budget``: why the loaded models still fill the budget (pinned or busy
    ones), or None.
    """

    failed: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    evicted: tuple[str, ...] = ()
    over_budget: str | None = None


@dataclass(frozen=True)
class FleetEvent:
    """A load, a failed load or an unload (idle, evicted, by an admin, removed)."""

    at: float
    model: str
    kind: str  # loaded | load_failed | unloaded | evicted | idle | removed | added
    detail: str = ""


@dataclass(frozen=True)
class ModelState:
    """One configured model: its entry, where it stands, what it holds."""

    id: str
    kind: str  # chat | embedding
    path: str | None
    aliases: tuple[str, ...]
    state: str  # one of STATES
    default: bool
    pinned: bool
    keep_alive: float | str  # seconds, or "forever"
    # Bytes held in the memory budget: weights (+ the prompt cache cap) and KV.
    weights_bytes: int
    reserved_bytes: int
    kv_bytes: int
    prompt_cache_bytes: int
    # Requests holding the model (waiting for it, queued or running in it).
    active: int
    # Requests waiting for this model to load (behind a load, or for memory).
    waiting: int
    wait_reason: str | None
    last_used: float | None
    loaded_at: float | None
    load_seconds: float | None
    error: str | None
    # What the model can do, once it has been loaded (ModelInfo fields); {} before.
    capabilities: dict[str, Any]
    # The engine's own numbers (rows, queue, tokens) when loaded; {} otherwise.
    engine: dict[str, Any]
    # A repo entry's Hugging Face repo and revision (None for a path or the demo).
    repo: str | None = None
    revision: str | None = None
    # What loading it reserves (weights estimated from its files, or the demo
    # model's, plus its prompt-cache cap); what it holds once loaded.
    load_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FleetStatus:
    """Every configured model and the memory budget they share (``/stats`` ``models``)."""

    budget_bytes: int
    used_bytes: int
    models: tuple[ModelState, ...]
    events: tuple[FleetEvent, ...]
    # Loads waiting for memory, first in line first.
    memory_queue: tuple[str, ...] = ()
    # Every event since start, counted: (model, kind, count).
    event_totals: tuple[tuple[str, str, int], ...] = ()
    # Why no request can be admitted: the reservations fill the budget (else None).
    over_budget: str | None = None

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes)

    def get(self, model_id: str) -> ModelState | None:
        return next((m for m in self.models if m.id == model_id), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "memory_queue": list(self.memory_queue),
            "over_budget": self.over_budget,
            "models": [m.as_dict() for m in self.models],
            "events": [asdict(e) for e in self.events],
        }
