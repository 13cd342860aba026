"""The prompt-cache panel: how much of the prompts the cache served, and why the rest missed.

Reads the default chat model's ``prompt_cache`` section of ``/stats``: the
hit ratio by tokens (prompt tokens of completed requests served from the
cache), the tiers (RAM, disk), the rules applied to agents' volatile
prompts, and the last lookups that were not full hits with where each
prompt diverged. The text around that point is prompt text: the HTTP side
blanks it for readers without admin access (``None``), and the panel then
says so instead.
"""

from __future__ import annotations

from typing import Any

from mlxd.dashboard.formatting import Formatted, ago, count, human_bytes, iso, percent, short_id

# Misses (partial hits included) listed, newest first.
SHOWN = 8
# Control characters made visible in a snippet (a newline is the common one).
_VISIBLE = {"\n": "⏎", "\r": "␍", "\t": "⇥"}


def visible(text: str) -> str:
    """A snippet with its line breaks and other control characters shown, not acted on."""
    return "".join(_VISIBLE.get(ch, "·" if ord(ch) < 32 else ch) for ch in text)


def prompt_cache_panel(s: dict[str, Any], now: float) -> Formatted:
    pc, c = s["prompt_cache"], s["counters"]
    admin = s.get("admin", False)
    lookups = pc.get("lookups", [])
    misses = [lk for lk in lookups if lk["diverged_at"] is not None][:SHOWN]
    return {
        "model": s["model"]["name"] or "—",
        "hit_ratio": percent(pc["cached_tokens_served"], c["prompt_tokens"]),
        "served": count(pc["cached_tokens_served"]),
        "prompt_tokens": count(c["prompt_tokens"]),
        "ram_tokens": count(pc.get("ram_tokens", 0)),
        "disk_tokens": count(pc.get("disk_tokens", 0)),
        "ram_bytes": human_bytes(pc["bytes"]),
        "ram_max": human_bytes(pc["max_bytes"]),
        "entries": count(pc["entries"]),
        "max_entries": count(pc["max_entries"]),
        "disk_bytes": human_bytes(pc.get("disk_bytes", 0)),
        "disk_entries": count(pc.get("disk_entries", 0)),
        # on, off (configured off, or a cluster) or failed (an error turned it off).
        "disk_state": pc.get("disk_state", "off"),
        "disk_error": pc.get("disk_error"),
        "checkpoints": count(pc.get("checkpoints", 0)),
        "corrupt": count(pc.get("disk_corrupt", 0)),
        "rules": [(rule, count(n)) for rule, n in sorted(pc.get("rules", {}).items())],
        "admin": admin,
        "misses": [_miss(lk, now, admin) for lk in misses],
        "lookups": len(lookups),
    }


def _miss(lookup: dict[str, Any], now: float, admin: bool) -> dict[str, Any]:
    cached, prompt = lookup["cached_tokens"], lookup["prompt_tokens"]
    before, after = lookup.get("before"), lookup.get("after")
    return {
        "id": lookup["request_id"],
        "short_id": short_id(lookup["request_id"]),
        "api": lookup["api"],
        "ago": ago(lookup["at"], now),
        "when_iso": iso(lookup["at"]),
        "cached": f"{count(cached)} / {count(prompt)}",
        "share": percent(cached, prompt),
        "source": lookup["source"],
        "diverged_at": count(lookup["diverged_at"]),
        # cached < diverged_at: more was shared than the model's cache could rewind to.
        "unreusable": count(lookup["diverged_at"] - cached)
        if lookup["diverged_at"] > cached
        else None,
        "rules": ", ".join(lookup.get("rules", [])),
        "before": visible(before) if admin and before is not None else None,
        "after": visible(after) if admin and after is not None else None,
    }
