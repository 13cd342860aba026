"""A request's prompt-cache lookup as its client sees it: the ``X-Mlxd-Prompt-Cache`` header.

Every generation response (chat, completions, Responses, Messages; streamed
or not) carries it, built from the engine's
:class:`~mlxd.engine.CacheLookup`::

    X-Mlxd-Prompt-Cache: cached=7207; prompt=7238; source=ram; diverged_at=7207

``key=value`` pairs joined by ``"; "``, in that order; ``diverged_at`` only on
a partial hit or a miss. No prompt text travels in it (the snippets around the
divergence point are in ``/stats``, for admins). ``X-Mlxd-Prompt-Rules`` names
the ``[prompt_cache] volatile_rules`` that changed the prompt, when any did.
:func:`parse_header` reads the header back (tests, benchmarks, scripts).
"""

from __future__ import annotations

from mlxd.engine import CacheLookup

PROMPT_CACHE_HEADER = "X-Mlxd-Prompt-Cache"
PROMPT_RULES_HEADER = "X-Mlxd-Prompt-Rules"


def header_value(lookup: CacheLookup) -> str:
    """``lookup`` as the ``X-Mlxd-Prompt-Cache`` value."""
    parts = [
        f"cached={lookup.cached_tokens}",
        f"prompt={lookup.prompt_tokens}",
        f"source={lookup.source}",
    ]
    if lookup.diverged_at is not None:
        parts.append(f"diverged_at={lookup.diverged_at}")
    return "; ".join(parts)


def parse_header(value: str) -> dict[str, int | str]:
    """An ``X-Mlxd-Prompt-Cache`` value as a dict; numbers as ints.

    ``parse_header("cached=7; prompt=9; source=ram; diverged_at=7")`` is
    ``{"cached": 7, "prompt": 9, "source": "ram", "diverged_at": 7}``.
    """
    out: dict[str, int | str] = {}
    for part in value.split(";"):
        key, sep, raw = part.strip().partition("=")
        if not sep:
            continue
        out[key] = int(raw) if raw.isdigit() else raw
    return out
