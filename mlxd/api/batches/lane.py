"""The idle-time lane's rules: how many batch lines a model may take now (pure, unit-tested).

Batch lines use only what interactive requests leave: none while a request
waits in the model's queue, none past ``[batches] max_rows`` (default: all
of the model's rows but one, so an interactive arrival always finds a free
row even where nothing preempts), none outside ``[batches] hours``. An
embedding model takes one line at a time, and only while it has nothing
else to do.

Loading is the other shared resource. The rule: a batch line never makes
room. Its model runs it when loaded; a model that is not loaded is loaded
for the batch only when the memory budget has room for it as it is (its
weights on disk fit in the free bytes, and no load waits for memory), so no
model an interactive user holds or may want is evicted for a batch. Until
then the batch waits, and says why.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatLoad:
    """A chat model's engine as the lane sees it (from its Snapshot)."""

    ready: bool
    rows: int  # running rows, batch lines included
    waiting: int  # requests in its queue, batch lines included
    width: int  # rows its batch may hold ([batch] size; 1 for a serial-only model)


def chat_room(load: ChatLoad, mine: int, max_rows: int | None) -> int:
    """How many more batch lines the model may take now (``mine``: lines of ours in it)."""
    if not load.ready or load.waiting > 0:
        return 0
    width = max(load.width, 1)
    if max_rows is None:
        cap = max(width - 1, 1)  # keep a row free for the next interactive arrival
        usable = cap
    else:
        cap = min(max_rows, width)
        usable = width
    busy = max(load.rows, mine)
    return max(0, min(cap - mine, usable - busy))


def embedding_room(ready: bool, queued: int, running: int, mine: int) -> int:
    """One line at a time, only while the embedding model is otherwise idle."""
    if not ready or mine > 0 or queued > 0 or running > 0:
        return 0
    return 1


def may_load(free_bytes: int, needed_bytes: int | None, loads_waiting: int) -> bool:
    """Whether a batch may load a model that is not loaded (never by evicting another)."""
    return needed_bytes is not None and loads_waiting == 0 and needed_bytes <= free_bytes


def parse_hours(hours: str) -> tuple[dt.time, dt.time]:
    start, end = hours.split("-")
    return dt.time.fromisoformat(start), dt.time.fromisoformat(end)


def in_hours(hours: str | None, now: dt.time) -> bool:
    """Whether ``now`` (local) is inside ``[batches] hours`` ("22:00-07:00" wraps midnight)."""
    if hours is None:
        return True
    start, end = parse_hours(hours)
    if start < end:
        return start <= now < end
    return now >= start or now < end
