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
resolves to an exception whose message is what the operator reads. A
request's own outcome crosses as a value (the engine's ``Failed``), never
as an exception: submitting requests is each kind's own API.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from mlxd.config import Settings
    from mlxd.engine.embeddings.messages import EmbeddingInfo, EmbeddingSnapshot
    from mlxd.engine.messages import ModelInfo
    from mlxd.engine.snapshot import Snapshot

    EngineInfo = ModelInfo | EmbeddingInfo
    EngineSnapshot = Snapshot | EmbeddingSnapshot

# The engine's info record (ModelInfo, EmbeddingInfo). Futures are invariant, so
# without covariance an engine whose load gives a ModelInfo would not be a
# ModelEngine of either kind; the fleet only awaits these futures, never
# resolves them, which is what makes the covariance safe.
InfoT = TypeVar("InfoT", covariant=True)


class ModelEngine(Protocol[InfoT]):  # pyright: ignore[reportInvalidTypeVarUse]  # see InfoT
    """What the fleet needs of one model's engine (chat or embedding)."""

    model_id: str

    def start(self) -> None:
        """Start the engine's threads.

        An engine made to load at start (a pinned model when the daemon
        starts, a cluster's model) loads then, and :meth:`wait_loaded` waits
        for that load; any other load is :meth:`load`'s.
        """
        ...

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the start-up load ended; then :attr:`load_error` says if it failed."""
        ...

    @property
    def load_error(self) -> str | None:
        """Why no model is loaded after the start-up load; None when one is."""
        ...

    def load(self, settings: Settings) -> concurrent.futures.Future[InfoT]:
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
    def info(self) -> InfoT | None:
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


if TYPE_CHECKING:
    # An engine of either kind, as the fleet holds it.
    AnyEngine = ModelEngine[EngineInfo]
