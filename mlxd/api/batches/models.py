"""Which model a batch line runs on, and how much room that model has for batch lines now.

The line's ``body.model`` is routed as the direct call would route it (an
id, an alias, or the default model of the endpoint's kind); the fleet's view
and the chat engine's snapshot give the numbers :mod:`mlxd.api.batches.lane`
decides on. A name that routes nowhere gets room for one line at a time: it
runs and gets the direct call's 404 or 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxd.api.batches.jsonl import RequestLine
from mlxd.api.batches.lane import ChatLoad, chat_room, embedding_room, may_load

if TYPE_CHECKING:
    from mlxd.engine import Fleet, FleetStatus, ModelState


@dataclass(frozen=True)
class Room:
    lines: int
    key: str  # the model id (or the name asked for, when it routes nowhere)
    reason: str | None = None  # why there is no room, for the dashboard
    # Whether the reason is worth a log line (not a busy engine: that passes).
    logged: bool = False


_KINDS = {"/v1/embeddings": "embedding", "/v1/rerank": "rerank"}


def kind_of(url: str) -> str:
    return _KINDS.get(url, "chat")


def route(status: FleetStatus, name: object, kind: str) -> ModelState | None:
    """The configured model a line's ``model`` names (None: it routes nowhere).

    ``/v1/rerank`` lines go to a reranker or an embedding model (cosine), as
    the route has it: no name, the default reranker, else the default
    embedding model.
    """
    kinds = ("rerank", "embedding") if kind == "rerank" else (kind,)
    if name is None:
        defaults = [m for m in status.models if m.default and m.kind in kinds]
        return min(defaults, key=lambda m: kinds.index(m.kind), default=None)
    if not isinstance(name, str):
        return None
    return next(
        (m for m in status.models if m.kind in kinds and (name == m.id or name in m.aliases)),
        None,
    )


def room_for(fleet: Fleet, line: RequestLine, mine: dict[str, int], max_rows: int | None) -> Room:
    """How many batch lines ``line``'s model may take now (``mine``: ours in flight, by model)."""
    kind = kind_of(line.url)
    status = fleet.status()
    model = route(status, line.body.get("model"), kind)
    if model is None:
        key = f"?{line.body.get('model')}"
        return Room(0 if mine.get(key) else 1, key)
    held = mine.get(model.id, 0)
    if model.state == "loaded":
        if kind != "chat":  # an embedding model's or a reranker's engine
            engine = model.engine
            lines = embedding_room(
                True, int(engine.get("queued", 0)), int(engine.get("running", 0)), held
            )
            return Room(lines, model.id, None if lines else f"{model.id} is busy")
        snapshot = fleet.snapshots().get(model.id)
        if snapshot is None:
            return Room(0, model.id, f"{model.id} has no engine")
        load = ChatLoad(
            ready=snapshot.state == "ready",
            rows=len(snapshot.rows),
            waiting=len(snapshot.pending),
            width=snapshot.batch.configured if snapshot.batch.batched else 1,
        )
        lines = chat_room(load, held, max_rows)
        reason = None
        if not lines:
            reason = (
                f"interactive requests wait for {model.id}"
                if load.waiting
                else f"{model.id} has no free row for batch lines"
            )
        return Room(lines, model.id, reason)
    if model.state in ("loading", "unloading") or held:
        return Room(0, model.id, f"{model.id} is {model.state}")
    # The fleet's own estimate, for a path-less demo entry too (its files are in the cache).
    if may_load(status.free_bytes, model.load_bytes, len(status.memory_queue)):
        return Room(1, model.id)
    return Room(
        0,
        model.id,
        f"{model.id} is not loaded and does not fit in the free memory budget "
        f"({_gib(model.load_bytes)} needed, {_gib(status.free_bytes)} free"
        f"{', a load waits for memory' if status.memory_queue else ''}); "
        "a batch never unloads a model to make room",
        logged=True,
    )


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
