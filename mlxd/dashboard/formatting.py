"""How the dashboard writes numbers, sizes, times and shares for people.

Shared by every region's formatter (:mod:`mlxd.dashboard.regions`) and the
config editor's panels.
"""

from __future__ import annotations

import time
from typing import Any

from mlxd.config import format_bytes

# What a formatter returns for a template: values ready to place, no arithmetic left.
Formatted = dict[str, Any]


def human_bytes(n: int | float | None) -> str:
    """``1.5 GiB``; an em dash for unknown."""
    return "—" if n is None else format_bytes(n)


def duration(seconds: float | None) -> str:
    """A short duration: ``0.42 s``, ``12 s``, ``3 m 04 s``, ``2 h 05 m``, ``3 d 4 h``."""
    if seconds is None:
        return "—"
    s = max(float(seconds), 0.0)
    if s < 10:
        return f"{s:.2f} s" if s < 1 else f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m} m {sec:02d} s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m:02d} m"
    d, h = divmod(h, 24)
    return f"{d} d {h} h"


def ratio(part: float, whole: float) -> float:
    """``part / whole`` as a fraction, 0 when ``whole`` is 0."""
    return part / whole if whole else 0.0


def percent(part: float, whole: float) -> str:
    """``42%``; ``<1%`` for small non-zero shares; an em dash when ``whole`` is 0."""
    if not whole:
        return "—"
    p = 100.0 * part / whole
    if 0 < p < 1:
        return "<1%"
    return f"{p:.0f}%"


def bar_width(part: float, whole: float) -> str:
    """A CSS width for a bar: clamped to 100%, and visible (0.5%) when non-zero."""
    p = min(100.0 * ratio(part, whole), 100.0)
    if part > 0 and p < 0.5:
        p = 0.5
    return f"{p:.1f}%"


def rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:.1f}"


def clock(ts: float | None) -> str:
    """Server-local ``HH:MM:SS``."""
    return "—" if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


def iso(ts: float | None) -> str:
    """ISO 8601 in UTC, for ``<time datetime>``."""
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def ago(ts: float | None, now: float) -> str:
    return "—" if ts is None else f"{duration(now - ts)} ago"


def short_id(request_id: str | None) -> str:
    """The distinctive end of a request id (``chatcmpl-…3f9a1c``)."""
    if not request_id:
        return "—"
    return request_id if len(request_id) <= 14 else f"…{request_id[-8:]}"


def count(n: int | float) -> str:
    """An integer with thousands separators."""
    return f"{int(n):,}"
