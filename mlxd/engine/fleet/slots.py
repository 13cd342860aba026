"""The fleet's slots and what its steps share: engines made per kind, routing, events, a signal.

Runs on the HTTP side's event loop, like every part of the fleet, so nothing
here needs a lock. :class:`Slots` holds one :class:`~mlxd.engine.fleet.slot.Slot`
per configured model and the running settings; it builds each model's
engine (the kind picks the maker), routes a request's name to its slot, and
keeps the event log and the change signal that loads waiting for memory,
unloads waiting for leases and the keep_alive tick listen to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxd.config import Settings
from mlxd.config.registry import for_model, registry, resolve
from mlxd.engine.fleet.slot import Slot, estimate_weights
from mlxd.engine.fleet.values import FleetEvent, FleetRefusal
from mlxd.engine.memory import MemoryPool
from mlxd.engine.messages import Failed

if TYPE_CHECKING:
    from mlxd.engine.model_engine import AnyEngine

# How often idle models are checked against keep_alive, and waiters re-check memory.
TICK_S = 1.0


# Where each kind is served, and what to do when the config has no model of a kind.
_ROUTES = {
    "chat": "/v1/chat/completions, /v1/completions, /v1/responses or /v1/messages",
    "embedding": "/v1/embeddings",
    "rerank": "/v1/rerank",
    "transcription": "/v1/audio/transcriptions and /v1/audio/translations",
    "speech": "/v1/audio/speech",
}
_NONE_OF_KIND = {
    "chat": "This server has no chat model. Add a [models.<id>] table with a path "
    "(docs/configuration.md#modelsid).",
    "embedding": "This server has no embedding model. Add one: a [models.<id>] table with "
    'kind = "embedding" and a path, or the built-in demo: [models.minilm] kind = '
    '"embedding" with no path (docs/configuration.md#embedding-models).',
    "transcription": "This server has no transcription model. Add one: a [models.<id>] table "
    'with kind = "transcription" and the path of a Whisper or Parakeet model '
    "(docs/configuration.md#transcription-models).",
    "speech": "This server has no speech model. Add one: a [models.<id>] table with "
    'kind = "speech" and the path of an mlx-audio text-to-speech model '
    "(docs/configuration.md#speech-models).",
    "rerank": "This server has no reranker or embedding model. Add one: a [models.<id>] table "
    'with kind = "rerank" (or "embedding") and a path (docs/configuration.md#rerankers).',
}


@dataclass(frozen=True)
class EngineMaker:
    """How the fleet builds one kind's engines: ``make(settings, model_id, pool, at_start)``."""

    make: Callable[[Settings, str, MemoryPool, bool], AnyEngine]
    # Whether ``make`` can build an engine that loads its model when it starts
    # (pinned models before the fleet runs; a cluster's one model always).
    loads_at_start: bool


class Slots:
    """Every configured model's slot and the bookkeeping the fleet's steps share."""

    def __init__(self, settings: Settings, pool: MemoryPool, makers: Mapping[str, EngineMaker]):
        self.settings = settings
        self.pool = pool
        self._makers = makers
        self.by_id: dict[str, Slot] = {}
        self.events: deque[FleetEvent] = deque(maxlen=100)
        self.event_totals: dict[tuple[str, str], int] = {}
        # Loads waiting for memory, first in line first.
        self.memory_queue: deque[Slot] = deque()
        self._changed: asyncio.Event | None = None

    # ------------------------------------------------------------ engines

    def add(self, model_id: str, settings: Settings) -> Slot:
        """A slot for ``settings``' entry ``model_id``, with its engine (not started)."""
        entry = registry(settings)[model_id]
        model_settings = for_model(settings, model_id)
        # Before run(), a pinned model loads on its engine thread (a cluster's one
        # model always: every rank loads its shard at start).
        pinned = entry.pin or settings.cluster is not None
        at_start = pinned and not self.running and self._makers[entry.kind].loads_at_start
        engine = self.make_engine(model_settings, model_id, entry.kind, at_start=at_start)
        slot = Slot(model_id, entry, model_settings, engine)
        if at_start:
            self.pool.settle(model_id, estimate_weights(entry) + slot.prompt_cache_cap())
            slot.state = "loading"
        self.by_id[model_id] = slot
        return slot

    def make_engine(
        self, settings: Settings, model_id: str, kind: str, *, at_start: bool = False
    ) -> AnyEngine:
        """A new engine for a model of ``kind`` (not started)."""
        return self._makers[kind].make(settings, model_id, self.pool, at_start)

    # ------------------------------------------------------------ routing

    def route(self, name: str | None, kind: str) -> Slot:
        """The slot ``name`` (an id, an alias, a pattern) stands for; raises FleetRefusal."""
        model_id = resolve(self.settings, name, kind)
        slot = self.by_id.get(model_id or "")
        if slot is None or slot.removed:
            ids = [i for i, s in self.by_id.items() if not s.removed and s.entry.kind == kind]
            raise FleetRefusal(
                Failed(
                    "model_not_found",
                    (
                        f"The model '{name or ''}' does not exist. This server serves "
                        + ", ".join(f"'{i}'" for i in ids)
                        + " (see /v1/models)."
                        if ids
                        else _NONE_OF_KIND[kind]
                    ),
                    404,
                    param="model",
                )
            )
        if slot.entry.kind != kind:
            message = self._kind_message(slot, kind)
            raise FleetRefusal(Failed("model_kind_mismatch", message, 400, param="model"))
        return slot

    def find(self, model_id: str) -> Slot:
        """The slot of the configured id ``model_id`` (admin actions); raises FleetRefusal."""
        slot = self.by_id.get(model_id)
        if slot is None or slot.removed:
            raise FleetRefusal(
                Failed(
                    "model_not_found",
                    f"No model '{model_id}' is configured (known: {', '.join(self.by_id)}).",
                    404,
                    param="model",
                )
            )
        return slot

    def _kind_message(self, slot: Slot, wanted: str) -> str:
        """A model of another kind: where it is served, and what this route (``wanted``) serves."""
        ids = [i for i, s in self.by_id.items() if not s.removed and s.entry.kind == wanted]
        here = (
            f"This route serves the {wanted} models: {', '.join(ids)}."
            if ids
            else _NONE_OF_KIND[wanted]
        )
        article = "an" if slot.entry.kind == "embedding" else "a"
        return (
            f"'{slot.id}' is {article} {slot.entry.kind} model: send it to "
            f"{_ROUTES[slot.entry.kind]}. {here}"
        )

    # ------------------------------------------------------------ events and the signal

    def event(self, model_id: str, kind: str, detail: str = "") -> None:
        self.events.append(FleetEvent(time.time(), model_id, kind, detail))
        key = (model_id, kind)
        self.event_totals[key] = self.event_totals.get(key, 0) + 1

    @property
    def running(self) -> bool:
        """The fleet's task runs (its signal exists): loads are the fleet's own now."""
        return self._changed is not None

    def open(self) -> None:
        """The fleet's task starts: from now on, waiters listen to the signal."""
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Something changed (a lease ended, a model unloaded): waiters look again."""
        if self._changed is not None:
            self._changed.set()

    async def until_removed(self, slot: Slot) -> None:
        """Until a reload removes ``slot`` (a load's waiter leaves then: :func:`removed`)."""
        while not slot.removed:
            await self.wait_change()

    async def wait_change(self) -> None:
        """Until something changes (a lease ends, a model unloads), or a tick passes."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), TICK_S)


def removed(slot: Slot) -> Failed:
    """The refusal of a request whose model a reload removed while it waited for its load."""
    return Failed(
        "model_not_found",
        f"The model '{slot.id}' was removed by a reload while this request waited for it "
        "to load (see /v1/models).",
        404,
        param="model",
    )
