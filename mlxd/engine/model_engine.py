"""The one interface a model's engine offers the fleet, whatever its kind.

A chat model's :class:`~mlxd.engine.chat.engine.Engine` and an embedding
model's :class:`~mlxd.engine.embeddings.engine.EmbeddingEngine` both
implement :class:`ModelEngine`: one thread that owns the model's MLX state
for the life of its registry entry, loaded and unloaded by command, its
state read from an immutable snapshot. The fleet (:mod:`mlxd.engine.fleet`)
is written against this protocol alone, so it never branches on a model's
kind to drive its engine.

Commands return :class:`concurrent.futures.Future`; the value that crosses
back is plain (an info record), and a command that cannot be carried out
resolves to an exception whose message is what the operator reads.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mlxd.config import Settings
    from mlxd.engine.embeddings.messages import EmbeddingInfo, EmbeddingSnapshot
    from mlxd.engine.messages import ModelInfo
    from mlxd.engine.snapshot import Snapshot

    EngineInfo = ModelInfo | EmbeddingInfo
    EngineSnapshot = Snapshot | EmbeddingSnapshot


class ModelEngine(Protocol):
    """What the fleet needs of one model's engine (chat or embedding)."""

    model_id: str

    def start(self) -> None:
        """Start the engine's threads; the model loads only when :meth:`load` says so."""
        ...

    def load(self, settings: Settings) -> concurrent.futures.Future[EngineInfo]:
        """Load ``settings``' model (draining what runs first); on failure the old one stays."""
        ...

    def unload(self) -> concurrent.futures.Future[None]:
        """Let what runs finish, then drop the model; the threads stay for the next load."""
        ...

    def apply(self, settings: Settings) -> concurrent.futures.Future[None]:
        """Take new live settings between two steps; nothing in flight is lost."""
        ...

    def rename(self, model_id: str) -> None:
        """Answer to ``model_id`` from now on (a reload renamed the entry)."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """End every request with an error and stop the threads (the entry is gone)."""
        ...

    def snapshot(self) -> EngineSnapshot:
        """The latest immutable view of the engine; never blocks."""
        ...

    @property
    def info(self) -> EngineInfo | None:
        """The loaded model's facts, or None while no model is loaded."""
        ...

    @property
    def busy(self) -> bool:
        """Requests queued or running."""
        ...

    @property
    def alive(self) -> bool:
        """The engine thread is running."""
        ...
