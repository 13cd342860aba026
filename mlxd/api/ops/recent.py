"""Latency of the requests that ended in the last few minutes, for the dashboard.

``/metrics`` histograms count since start; an operator looking at the
dashboard wants "now": p50 and p95 of time to first token, end-to-end time
and inter-token latency over a sliding window. Fed by ``AppState.observers``
like the histograms, one entry per completed request.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxd.engine import Finished

if TYPE_CHECKING:
    from mlxd.api.state import AppState
    from mlxd.engine import Accepted, Failed

WINDOW_S = 300.0
MAX_KEPT = 20_000


def inter_token_s(outcome: Finished) -> float | None:
    """A request's mean inter-token latency: (last token - first token) / (tokens - 1)."""
    tokens, decode = outcome.usage.completion_tokens, outcome.timings.decode_s
    if tokens < 2 or decode is None:
        return None
    return max(decode, 0.0) / (tokens - 1)


@dataclass(frozen=True)
class _Ended:
    at: float
    ttft_s: float | None
    total_s: float
    itl_s: float | None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class RecentRequests:
    """A sliding window of completed requests' timings."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._ended: deque[_Ended] = deque(maxlen=MAX_KEPT)
        self._lock = threading.Lock()

    def observe(self, accepted: Accepted, outcome: Finished | Failed) -> None:
        if not isinstance(outcome, Finished):
            return
        t = outcome.timings
        entry = _Ended(time.time(), t.ttft_s, t.total_s, inter_token_s(outcome))
        with self._lock:
            self._ended.append(entry)

    def percentiles(self, now: float) -> dict[str, Any]:
        """p50/p95 of each timing over the window (seconds; None when nothing ended)."""
        since = now - self.window_s
        with self._lock:
            while self._ended and self._ended[0].at < since:
                self._ended.popleft()
            ended = list(self._ended)
        out: dict[str, Any] = {"window_s": self.window_s, "requests": len(ended)}
        for name, values in (
            ("ttft", [e.ttft_s for e in ended if e.ttft_s is not None]),
            ("e2e", [e.total_s for e in ended]),
            ("itl", [e.itl_s for e in ended if e.itl_s is not None]),
        ):
            out[f"{name}_p50_s"] = percentile(values, 50)
            out[f"{name}_p95_s"] = percentile(values, 95)
        return out


_installed: weakref.WeakKeyDictionary[AppState, RecentRequests] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


def install_recent(state: AppState) -> RecentRequests:
    """The window of ``state``, created and subscribed to its observers once."""
    with _install_lock:
        recent = _installed.get(state)
        if recent is None:
            recent = RecentRequests()
            state.observers.append(recent.observe)
            _installed[state] = recent
        return recent
