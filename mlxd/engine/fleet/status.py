"""What the fleet looks like from outside: its slots read into plain values.

``/v1/models``, ``/stats``, ``/metrics`` and the dashboard take a
:class:`~mlxd.engine.fleet.values.FleetStatus` rebuilt on demand, one pool view
per fleet view. A model's kind decides what its row shows: a chat model's
numbers come from its engine's ``Snapshot``, an embedding model's are its
``EmbeddingSnapshot`` as is.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from mlxd.config.registry import default_id
from mlxd.engine.fleet.fit import over_budget
from mlxd.engine.fleet.slot import Slot, estimate_weights
from mlxd.engine.fleet.slots import Slots
from mlxd.engine.fleet.values import FleetStatus, ModelState
from mlxd.engine.memory import PoolUsage
from mlxd.engine.snapshot import Snapshot

# What a loaded model can do, from its info record (ModelInfo or EmbeddingInfo).
_CAPABILITIES = (
    "context_length",
    "family",
    "dtype",
    "tool_format",
    "reasoning",
    "structured_output",
    "vision",
    "batchable",
    "vocab_size",
    "max_token_chars",
    "dimensions",
    "supports_dimensions",
    "sample_rate",  # a speech model's (kind = "speech"), with its voices
    "voices",
)


def fleet_view(slots: Slots) -> FleetStatus:
    """Every configured model and the budget they share."""
    pool = slots.pool.usage()
    return FleetStatus(
        budget_bytes=pool.budget,
        used_bytes=pool.used,
        models=tuple(state_of(slots, s, pool) for s in slots.by_id.values()),
        events=tuple(slots.events),
        memory_queue=tuple(s.id for s in slots.memory_queue),
        event_totals=tuple((m, k, n) for (m, k), n in slots.event_totals.items()),
        over_budget=over_budget(slots),
    )


def chat_snapshots(slots: Slots) -> dict[str, Snapshot]:
    """Each chat model's engine Snapshot, loaded or not."""
    out: dict[str, Snapshot] = {}
    for model_id, slot in slots.by_id.items():
        snapshot = slot.engine.snapshot()
        if isinstance(snapshot, Snapshot):
            out[model_id] = snapshot
    return out


def state_of(slots: Slots, slot: Slot, pool: PoolUsage | None = None) -> ModelState:
    """``slot`` as its row in the views (``default``: it is its kind's default model)."""
    default = slot.id == default_id(slots.settings, slot.entry.kind)
    return model_state(slot, pool or slots.pool.usage(), default)


def model_state(slot: Slot, pool: PoolUsage, default: bool) -> ModelState:
    """What ``slot`` looks like from outside (``/v1/models``, ``/stats``, the dashboard)."""
    held = next((e for e in pool.entries if e.model_id == slot.id), None)
    cap = slot.prompt_cache_cap() if held else 0
    capabilities: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    prompt_cache = 0
    if slot.state == "loaded":
        info = slot.engine.info
        capabilities = _capabilities(asdict(info)) if info is not None else {}
        snapshot = slot.engine.snapshot()
        if isinstance(snapshot, Snapshot):
            prompt_cache = snapshot.prompt_cache.bytes
            engine = _chat_numbers(snapshot)
        else:
            engine = asdict(snapshot)
    return ModelState(
        id=slot.id,
        kind=slot.entry.kind,
        path=slot.entry.path,
        repo=slot.entry.repo,
        revision=slot.entry.repo_revision if slot.entry.repo else None,
        aliases=tuple(slot.entry.aliases),
        state=slot.state,
        default=default,
        pinned=slot.pinned,
        keep_alive=slot.entry.keep_alive,
        weights_bytes=(held.fixed - cap) if held else 0,
        reserved_bytes=held.fixed if held else 0,
        kv_bytes=held.kv if held else 0,
        prompt_cache_bytes=prompt_cache,
        active=slot.active,
        waiting=slot.waiting,
        wait_reason=slot.wait_reason,
        last_used=slot.last_used,
        loaded_at=slot.loaded_at,
        load_seconds=slot.load_seconds,
        error=slot.error,
        capabilities=capabilities,
        engine=engine,
        load_bytes=held.fixed if held else estimate_weights(slot.entry) + slot.prompt_cache_cap(),
    )


def _chat_numbers(snapshot: Snapshot) -> dict[str, Any]:
    return {
        "stalled_reason": snapshot.stalled_reason(time.time()),
        "rows": len(snapshot.rows),
        "pending": len(snapshot.pending),
        "kv_bytes": snapshot.batch.kv_bytes,
        "kv_budget_bytes": snapshot.batch.kv_budget_bytes,
        "tokens_per_s": snapshot.throughput.get("last_minute_tps", 0.0),
        # Its prompt cache: sizes, tiers, rules applied and the last lookups.
        "prompt_cache": asdict(snapshot.prompt_cache),
        "counters": {
            k: v
            for k, v in snapshot.counters.items()
            if isinstance(v, int) and not isinstance(v, bool)
        },
    }


def _capabilities(info: dict[str, Any]) -> dict[str, Any]:
    out = {k: info[k] for k in _CAPABILITIES if k in info}
    if "tool_format" in out:
        out["tools"] = out["tool_format"] is not None
    if info.get("scoring"):  # a reranker's: "cross_encoder" or "yes_no_lm"
        out["scoring"] = info["scoring"]
    return out
