"""``/admin/memory``: where the daemon's memory goes, for finding a leak (admin only).

``GET /admin/memory`` answers the process's resident memory, the Python
heap by allocation site and the live objects by type, each against a
baseline (``POST /admin/memory/baseline`` takes a new one), and
``POST /admin/memory/trim`` collects garbage and hands glibc's free heap
pages back to the system (``malloc_trim``), answering what that freed.

Allocation sites need ``tracemalloc``, which costs time and memory on every
allocation, so it is opt-in: ``MLXD_TRACEMALLOC=<frames>`` in the daemon's
environment starts it (:func:`start_from_env`, called when the daemon starts)
with that many frames per site. Without it the routes still answer RSS and
object counts. benchmarks/soak.py reads these while it runs a mixed load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time
import tracemalloc
from collections import Counter
from typing import Any

from litestar import Controller, get, post
from litestar.params import FromQuery

from mlxd.api.ops.admin import admin_guard

ENV = "MLXD_TRACEMALLOC"


class _Baseline:
    snapshot: tracemalloc.Snapshot | None = None
    types: Counter[str] = Counter()
    rss: int = 0
    at: float = 0.0


_BASE = _Baseline()


def start_from_env() -> None:
    """Start tracemalloc when ``MLXD_TRACEMALLOC`` names a frame count (>= 1)."""
    value = os.environ.get(ENV, "").strip()
    if value.isdigit() and int(value) >= 1 and not tracemalloc.is_tracing():
        tracemalloc.start(int(value))


def rss_bytes() -> int:
    """The process's resident set size (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _types() -> Counter[str]:
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def take_baseline() -> None:
    gc.collect()
    _BASE.snapshot = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    _BASE.types = _types()
    _BASE.rss = rss_bytes()
    _BASE.at = time.time()


def report(limit: int) -> dict[str, Any]:
    """RSS, allocation sites and object types, each with its growth since the baseline."""
    if not _BASE.at:
        take_baseline()
    gc.collect()
    types = _types()
    grown = (types - _BASE.types).most_common(limit)
    body: dict[str, Any] = {
        "rss_bytes": rss_bytes(),
        "rss_growth_bytes": rss_bytes() - _BASE.rss,
        "since_s": round(time.time() - _BASE.at, 1),
        "objects": sum(types.values()),
        "object_types_grown": [{"type": t, "count": types[t], "growth": n} for t, n in grown],
        "tracemalloc": None,
    }
    if tracemalloc.is_tracing():
        now = tracemalloc.take_snapshot()
        traced, peak = tracemalloc.get_traced_memory()
        stats = (
            now.compare_to(_BASE.snapshot, "traceback")
            if _BASE.snapshot is not None
            else [s for s in now.statistics("traceback")]
        )
        top = []
        for s in stats[:limit]:
            frames = [f"{f.filename}:{f.lineno}" for f in s.traceback]
            top.append(
                {
                    "where": frames[0] if frames else "?",
                    "stack": frames,
                    "size_bytes": s.size,
                    "size_growth_bytes": getattr(s, "size_diff", s.size),
                    "count_growth": getattr(s, "count_diff", s.count),
                }
            )
        body["tracemalloc"] = {"traced_bytes": traced, "peak_bytes": peak, "top": top}
    return body


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: free heap pages back to the system (False: not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError, TypeError):
        return False


class MemoryController(Controller):
    path = "/admin/memory"
    guards = [admin_guard]

    @get("/")
    async def show(self, limit: FromQuery[int] = 25) -> dict[str, Any]:
        """Memory now and its growth since the baseline, largest first."""
        return report(max(1, min(limit, 200)))

    @post("/baseline", status_code=200)
    async def baseline(self) -> dict[str, Any]:
        """Take a new baseline (after a warm-up, say)."""
        take_baseline()
        return {"rss_bytes": _BASE.rss, "tracing": tracemalloc.is_tracing()}

    @post("/trim", status_code=200)
    async def trim(self) -> dict[str, Any]:
        """Collect garbage and ``malloc_trim``; the RSS before and after."""
        before = rss_bytes()
        collected = gc.collect()
        trimmed = malloc_trim()
        return {
            "rss_before_bytes": before,
            "rss_after_bytes": rss_bytes(),
            "gc_collected": collected,
            "malloc_trim": trimmed,
        }
