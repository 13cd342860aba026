"""A request's priority class, from its key and its body (issue 23).

A key's ``priority`` is the most urgent class its requests run at. A request
may ask for a less urgent one: the ``priority`` body field (``"high"``,
``"normal"``, ``"low"``, or vLLM's integer: negative is high, 0 normal,
positive low), or OpenAI's
``service_tier`` (``"flex"``: low; ``"priority"``: high; ``"auto"`` and
``"default"``: the key's class). It never runs above its key's class.
"""

from __future__ import annotations

from typing import Any

from mlxd.api.http.errors import OpenAIError
from mlxd.engine import PRIORITY_CLASSES, capped_priority

# What a request may ask for in its body; "batch" is the Batch API's own class.
ASKABLE = ("high", "normal", "low")
_TIERS = {"flex": "low", "priority": "high", "auto": None, "default": None}


def requested(body: Any) -> str | None:
    """The class a request body asks for, or None (a 400 for a value mlxd does not know)."""
    value = getattr(body, "priority", None)
    if isinstance(value, int) and not isinstance(value, bool):
        # vLLM's integer priority: lower is handled earlier, 0 is the default.
        return "high" if value < 0 else "normal" if value == 0 else "low"
    if value is not None:
        if value not in ASKABLE:
            raise OpenAIError(
                400,
                f"'priority' must be one of {', '.join(repr(c) for c in ASKABLE)} or an "
                f"integer as vLLM's (negative: high, 0: normal, positive: low) (got {value!r}); "
                "a request runs at most at its API key's priority.",
                code="invalid_value",
                param="priority",
            )
        return value
    tier = getattr(body, "service_tier", None)
    if isinstance(tier, str) and tier in _TIERS:
        return _TIERS[tier]
    return None


def effective(current: str, ceiling: str, asked: str | None) -> str:
    """The class a request runs at: what it asked for, capped at its caller's ``ceiling``.

    ``ceiling`` is :attr:`Caller.priority <mlxd.api.http.caller.Caller.priority>`
    (its key's class; "batch" for a Batch API line, which nothing raises).
    ``current`` is the request's class as built ("batch" stays "batch").
    """
    if ceiling == "batch":
        return "batch"
    if current == "batch" or current not in PRIORITY_CLASSES:
        return "batch" if current == "batch" else ceiling
    wanted = asked if asked is not None else (current if current != "normal" else None)
    return capped_priority(wanted, ceiling)
