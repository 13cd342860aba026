"""Byte sizes and durations as the config file writes them ("6GiB", "30m")."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, PlainSerializer

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """Parse a byte count: an integer, or a human string such as ``"6GiB"``.

    Decimal units (``KB``, ``MB``, ``GB``, ``TB``) are powers of 1000, binary
    units (``KiB``, ``MiB``, ``GiB``, ``TiB``) powers of 1024.

    Raises:
        ValueError: for negative numbers, unknown units or anything else.
    """
    if isinstance(value, bool):
        raise ValueError("expected a byte size such as 6GiB, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative (got {value})")
        return value
    if isinstance(value, float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a byte size must be a finite, non-negative number (got {value})")
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not a byte size (examples: 512MiB, 6GiB, 2GB)")
        number, unit = match.groups()
        factor = _UNITS.get(unit.lower())
        if factor is None:
            raise ValueError(
                f"unknown unit {unit!r} in {value!r} (use B, KB, MB, GB, KiB, MiB, GiB)"
            )
        return int(float(number) * factor)
    raise ValueError(f"expected a byte size such as 6GiB, got {type(value).__name__}")


def format_bytes(n: int | float) -> str:
    """Render a byte count for people: ``1.5 GiB``, ``512 MiB``, ``320 B``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# Keys whose integer values are byte counts, beside every ``*_bytes`` key.
_BYTE_KEYS = ("budget", "kv_budget")


def shown_value(key: str, value: Any) -> str:
    """A config value as a person reads it in reload output and events: byte sizes
    in human units (``memory.budget`` 2147483648 is ``2.0 GiB``), None as ``unset``."""
    name = key.rsplit(".", 1)[-1]
    if value is None:
        return "unset"
    bytes_key = name.endswith("bytes") or name in _BYTE_KEYS
    if bytes_key and isinstance(value, int) and not isinstance(value, bool):
        return format_bytes(value)
    if isinstance(value, str):
        return value
    import json

    return json.dumps(value, default=str)


def _exact_size(n: int) -> str | int:
    """The shortest exact spelling of a byte count, for writing TOML."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return n


Bytes = Annotated[
    int,
    BeforeValidator(parse_bytes),
    PlainSerializer(_exact_size, when_used="json"),
]


def _parse_budget(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = parse_bytes(value)
    if n <= 0:
        raise ValueError('must be a positive size such as 512MiB or 8GiB, or "auto"')
    return n


KvBudget = Annotated[
    Literal["auto"] | int,
    BeforeValidator(_parse_budget),
    PlainSerializer(lambda v: v if v == "auto" else _exact_size(v), when_used="json"),
]


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_keep_alive(value: Any) -> Any:
    """``"forever"`` or seconds: a number, or a string such as ``"90s"``, ``"30m"``, ``"2h"``.

    Ollama spells "never unload" as a negative number; ``-1`` is read as
    ``"forever"`` too.
    """
    if isinstance(value, bool):
        raise ValueError('expected a duration such as "30m" or "forever", not a boolean')
    if isinstance(value, str) and value.strip().lower() in ("forever", "never", "inf"):
        return "forever"
    if isinstance(value, int | float):
        if value < 0:
            return "forever"
        if not math.isfinite(value):
            return "forever"
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value.lower())
        if match is None:
            raise ValueError(
                f'{value!r} is not a duration (examples: "90s", "30m", "2h", "forever")'
            )
        number, unit = match.groups()
        return float(number) * _SECONDS[unit]
    raise ValueError(f'expected a duration such as "30m" or "forever", got {type(value).__name__}')


def _format_seconds(value: Any) -> Any:
    if value == "forever":
        return value
    for unit, factor in (("h", 3600), ("m", 60)):
        if value and value % factor == 0:
            return f"{int(value // factor)}{unit}"
    return f"{value:g}s"


KeepAlive = Annotated[
    Literal["forever"] | float,
    BeforeValidator(parse_keep_alive),
    PlainSerializer(_format_seconds, when_used="json"),
]
