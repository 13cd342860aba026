"""The bounded in-memory store behind the Responses API's ``previous_response_id``.

A stored response keeps its JSON (for ``GET /v1/responses/{id}``) and the
conversation it ended, as chat messages, so a later request can continue it.
The store is bounded by count (``[responses] max_stored``, oldest evicted
first) and by age (``[responses] ttl``); both are read on every call, so a
reload applies at once. It is used from the event loop only: no locking.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    id: str
    body: dict[str, Any]
    # The conversation up to and including this response's output, as the
    # chat messages the engine renders (instructions are not carried over).
    messages: tuple[dict, ...]
    stored_at: float


class ResponseStore:
    """Responses by id, bounded by count and age."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(
        self,
        rid: str,
        body: dict[str, Any],
        messages: tuple[dict, ...],
        *,
        max_stored: int,
        ttl: float,
    ) -> bool:
        """Keep a response; False when the store holds none (``max_stored`` is 0)."""
        self._expire(ttl)
        if max_stored <= 0:
            return False
        self._items[rid] = StoredResponse(rid, body, messages, self._clock())
        self._items.move_to_end(rid)
        while len(self._items) > max_stored:
            self._items.popitem(last=False)
        return True

    def get(self, rid: str, *, ttl: float) -> StoredResponse | None:
        """The response, or None when it was never stored, was evicted or expired."""
        self._expire(ttl)
        return self._items.get(rid)

    def delete(self, rid: str, *, ttl: float) -> bool:
        self._expire(ttl)
        return self._items.pop(rid, None) is not None

    def _expire(self, ttl: float) -> None:
        cutoff = self._clock() - ttl
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.stored_at > cutoff:
                return
            self._items.popitem(last=False)
