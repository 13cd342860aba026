"""Per-key quotas: requests and tokens per rolling minute, requests in flight.

:class:`Quotas` lives in :class:`~mlxd.api.state.AppState`, on the event
loop, keyed by the key's name: its counts survive a reload (the same name
keeps its window) but not a restart. A request over a limit gets 429 with
``Retry-After`` and the rate-limit headers; every answer of a key with a
limit carries them:

- OpenAI's names (``x-ratelimit-limit-requests``, ``-remaining-``,
  ``-reset-`` and the ``-tokens`` ones, resets written ``"1.5s"``);
- on ``/v1/messages``, Anthropic's (``anthropic-ratelimit-requests-limit``,
  ``-remaining``, ``-reset`` as an RFC 3339 time, and the ``tokens`` ones).

Tokens (prompt + generated) are counted when a request ends, so a key may
go over its ``tokens_per_minute`` by the requests in flight when it crosses
it; the next request is refused until the window has room again.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.keys import Who

WINDOW_S = 60.0


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    in_flight: int = 0
    refused: int = 0
    # Since the daemon started (the key's /metrics counters).
    requests_total: int = 0
    tokens_total: int = 0

    def expire(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


@dataclass(frozen=True)
class KeyUsage:
    """One key's counts now (for /stats, the dashboard and ``mlxd status``)."""

    requests_last_minute: int
    tokens_last_minute: int
    in_flight: int
    refused: int
    requests_total: int
    tokens_total: int


class Quotas:
    """Every key's rolling-minute counts and requests in flight."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def _of(self, name: str) -> _Usage:
        return self._usage.setdefault(name, _Usage())

    def take(self, who: Who | None, *, anthropic: bool = False) -> Callable[[], None]:
        """Count one request of ``who`` or refuse it (429); returns its release.

        The request's rate-limit headers are :meth:`headers`.
        """
        if who is None:
            return _nothing
        now = self._clock()
        usage = self._of(who.name)
        usage.expire(now)
        problem = self._over(who, usage, now)
        if problem is not None:
            usage.refused += 1
            message, retry = problem
            headers = {"Retry-After": str(max(1, math.ceil(retry)))}
            headers.update(self.headers(who, anthropic=anthropic))
            raise OpenAIError(429, message, code="rate_limit_exceeded", headers=headers)
        usage.requests.append(now)
        usage.requests_total += 1
        usage.in_flight += 1
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                usage.in_flight -= 1

        return release

    def _over(self, who: Who, usage: _Usage, now: float) -> tuple[str, float] | None:
        if who.requests_per_minute and len(usage.requests) >= who.requests_per_minute:
            retry = usage.requests[0] + WINDOW_S - now
            return (
                f"Rate limit reached for key '{who.name}': {who.requests_per_minute} requests "
                f"per minute. Retry in {retry:.1f}s.",
                retry,
            )
        if who.tokens_per_minute and usage.token_sum >= who.tokens_per_minute:
            retry = _tokens_free_in(usage, who.tokens_per_minute, now)
            return (
                f"Rate limit reached for key '{who.name}': {who.tokens_per_minute} tokens "
                f"per minute ({usage.token_sum} used). Retry in {retry:.1f}s.",
                retry,
            )
        if who.max_concurrent and usage.in_flight >= who.max_concurrent:
            return (
                f"Too many concurrent requests for key '{who.name}': at most "
                f"{who.max_concurrent} at once. Retry when one has finished.",
                1.0,
            )
        return None

    def spend(self, who: Who | None, tokens: int) -> None:
        """Count ``tokens`` (prompt + generated) of a request of ``who`` that ended."""
        if who is None or tokens <= 0:
            return
        usage = self._of(who.name)
        usage.tokens.append((self._clock(), tokens))
        usage.token_sum += tokens
        usage.tokens_total += tokens

    def count_outside(self, who: Who | None, *, requests: int = 0, tokens: int = 0) -> None:
        """Count a Batch API line of ``who`` in the key's totals only (not in its quotas)."""
        if who is None:
            return
        usage = self._of(who.name)
        usage.requests_total += requests
        usage.tokens_total += max(tokens, 0)

    def usage(self, name: str) -> KeyUsage:
        usage = self._usage.get(name)
        if usage is None:
            return KeyUsage(0, 0, 0, 0, 0, 0)
        usage.expire(self._clock())
        return KeyUsage(
            len(usage.requests),
            usage.token_sum,
            usage.in_flight,
            usage.refused,
            usage.requests_total,
            usage.tokens_total,
        )

    def headers(self, who: Who | None, *, anthropic: bool = False) -> dict[str, str]:
        """The rate-limit headers of ``who`` now; none for a key without limits."""
        if who is None or not (who.requests_per_minute or who.tokens_per_minute):
            return {}
        now = self._clock()
        usage = self._of(who.name)
        usage.expire(now)
        out: dict[str, str] = {}
        if who.requests_per_minute:
            left = max(0, who.requests_per_minute - len(usage.requests))
            reset = usage.requests[0] + WINDOW_S - now if usage.requests else 0.0
            out.update(_named("requests", who.requests_per_minute, left, reset, anthropic))
        if who.tokens_per_minute:
            left = max(0, who.tokens_per_minute - usage.token_sum)
            reset = _tokens_free_in(usage, 0, now) if usage.tokens else 0.0
            out.update(_named("tokens", who.tokens_per_minute, left, reset, anthropic))
        return out


def _tokens_free_in(usage: _Usage, limit: int, now: float) -> float:
    """Seconds until the window holds fewer than ``limit`` tokens (0: until it is empty)."""
    total = usage.token_sum
    for at, n in usage.tokens:
        total -= n
        if total < limit or (limit == 0 and total <= 0):
            return max(0.0, at + WINDOW_S - now)
    return 0.0


def _named(what: str, limit: int, left: int, reset: float, anthropic: bool) -> dict[str, str]:
    if anthropic:
        at = datetime.now(timezone.utc).timestamp() + max(0.0, reset)
        stamp = datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds")
        base = f"anthropic-ratelimit-{what}"
        return {
            f"{base}-limit": str(limit),
            f"{base}-remaining": str(left),
            f"{base}-reset": stamp.replace("+00:00", "Z"),
        }
    return {
        f"x-ratelimit-limit-{what}": str(limit),
        f"x-ratelimit-remaining-{what}": str(left),
        f"x-ratelimit-reset-{what}": f"{max(0.0, reset):.3f}s".replace(".000s", "s"),
    }


def _nothing() -> None:
    return None
