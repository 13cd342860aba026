"""The bounded in-memory store behind the Responses API's ``previous_response_id``.

A stored response keeps its JSON (for ``GET /v1/responses/{id}``) and the
conversation it ended, as chat messages, so a later request can continue it;
both are kept serialized, so what an entry costs is what it counts. The store
is bounded by count (``[responses] max_stored``), by bytes (``max_bytes``;
oldest evicted first) and by age (``ttl``): an entry leaves at its expiry
time, whether or not anything else happens, and the memory freed is handed
back to the operating system. The bounds are read on every call, so a reload
applies at once.

Each entry belongs to the API key that created it: a keyed request sees,
continues and deletes only its own key's responses (any other id is "not
found"), and the store keeps an HMAC of the key, never the key. Without
``[server] api_keys`` there are no owners. It is used from the event loop
only: no locking.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hashlib
import hmac
import logging
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec

from mlxd.config import ResponsesSettings

logger = logging.getLogger(__name__)

# Per process: the store dies with it, and an owner id is useless elsewhere.
_OWNER_KEY = secrets.token_bytes(32)
# Freed bytes after which the C heap is trimmed (glibc keeps freed memory).
_TRIM_AFTER = 1 << 20


def owner_of(key: str | None) -> str | None:
    """What the store keeps of the API key a request presented (None without keys).

    ``key`` is the caller's :attr:`~mlxd.api.http.caller.Caller.owner` (the
    key's digest), hashed once more under this process's own secret.
    """
    if key is None:
        return None
    return hmac.new(_OWNER_KEY, key.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str | None
    # The Response object, as JSON.
    body: bytes
    # The conversation up to and including this response's output, as the
    # chat messages the engine renders (instructions are not carried over), as JSON.
    conversation: bytes
    stored_at: float

    @property
    def size(self) -> int:
        return len(self.body) + len(self.conversation)

    def messages(self) -> tuple[dict, ...]:
        """The conversation, decoded for a request that continues it."""
        return tuple(msgspec.json.decode(self.conversation))


class ResponseStore:
    """Responses by id, bounded by count, bytes and age, each visible to its owner only.

    Args:
        limits: The live ``[responses]`` settings, read on every call.
        clock: Monotonic seconds (a fake one in tests).
    """

    def __init__(
        self,
        limits: Callable[[], ResponsesSettings],
        clock: Callable[[], float] = time.monotonic,
    ):
        self._limits = limits
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._freed = 0
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """What the stored responses take, serialized."""
        return self._bytes

    def put(
        self, rid: str, body: dict[str, Any], messages: tuple[dict, ...], *, owner: str | None
    ) -> bool:
        """Keep a response; False when it is not kept (``max_stored`` 0, or larger than
        ``max_bytes`` on its own)."""
        limits = self._limits()
        self.expire()
        if limits.max_stored <= 0:
            return False
        entry = StoredResponse(
            rid,
            owner,
            msgspec.json.encode(body),
            msgspec.json.encode(messages),
            self._clock(),
        )
        if entry.size > limits.max_bytes:
            logger.info(
                "response %s not stored: %d bytes, more than [responses] max_bytes",
                rid,
                entry.size,
            )
            return False
        self._remove(rid)
        self._items[rid] = entry
        self._bytes += entry.size
        while len(self._items) > limits.max_stored or self._bytes > limits.max_bytes:
            self._remove(next(iter(self._items)))
        self._release()
        self._arm()
        return True

    def get(self, rid: str, *, owner: str | None) -> StoredResponse | None:
        """The response, or None when it was never stored, was evicted, expired, or
        belongs to another key."""
        self.expire()
        entry = self._items.get(rid)
        if entry is None or not _same(entry.owner, owner):
            return None
        return entry

    def delete(self, rid: str, *, owner: str | None) -> bool:
        if self.get(rid, owner=owner) is None:
            return False
        self._remove(rid)
        self._release()
        return True

    def expire(self) -> None:
        """Drop what is older than ``ttl`` (and shrink to lowered bounds)."""
        limits = self._limits()
        cutoff = self._clock() - limits.ttl
        while self._items:
            oldest = next(iter(self._items.values()))
            too_many = len(self._items) > limits.max_stored or self._bytes > limits.max_bytes
            if oldest.stored_at > cutoff and not too_many:
                break
            self._remove(oldest.id)
        self._release()

    def _remove(self, rid: str) -> None:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.size
            self._freed += entry.size

    def _release(self) -> None:
        if self._freed >= _TRIM_AFTER:
            self._freed = 0
            trim_heap()

    def _arm(self) -> None:
        """Wake up when the oldest entry expires (only with a running event loop)."""
        if self._timer is not None or not self._items:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        oldest = next(iter(self._items.values()))
        delay = max(0.0, oldest.stored_at + self._limits().ttl - self._clock())
        self._timer = loop.call_later(delay + 0.05, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self.expire()
        self._arm()


def _same(stored: str | None, asking: str | None) -> bool:
    if stored is None or asking is None:
        return stored is asking
    return hmac.compare_digest(stored, asking)


@cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand freed C-heap memory back to the OS (glibc keeps it otherwise; no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
