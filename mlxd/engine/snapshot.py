"""The engine's state as one immutable value: the contract of /stats and the dashboard.

The engine thread builds a :class:`Snapshot` after each step and swaps it in;
readers take the current one without locking. Nothing here holds secrets;
the only prompt text is ``lookups`` (snippets around a prompt-cache
divergence), which ``as_dict``, the JSON shape documented in docs/api.md,
leaves out.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from mlxd.engine.cluster_status import ClusterStatus
from mlxd.engine.messages import CacheLookup
from mlxd.engine.policy.drain import DrainEvent

# An engine with work that finished no step for this long counts as stalled.
STEP_STALL_S = 60.0


@dataclass(frozen=True)
class ServedModel:
    name: str | None
    path: str | None
    family: str | None
    context: int | None
    batchable: bool
    cache_kinds: tuple[str, ...]
    status: str  # "loading" | "ready" | "failed" | "swapping"
    error: str | None = None
    vocab_size: int | None = None
    dtype: str | None = None
    weights_bytes: int = 0


@dataclass(frozen=True)
class RunningRow:
    id: str
    api: str  # chat | completions | responses | messages
    lane: str
    phase: str
    prompt_tokens: int
    cached_tokens: int
    prefill_done: int
    prefill_total: int
    generated_tokens: int
    max_tokens: int
    tokens_per_s: float
    received_at: float
    kv_bytes: int
    projected_kv_bytes: int
    # "json" or "tools" when a grammar constrains the row.
    constraint: str | None = None
    # Where the output is: "answer", "reasoning" (inside think markers) or "tool" (a call).
    output: str = "answer"
    # Scheduling (issue 23): its priority class, its API key's name, times it yielded.
    priority: str = "normal"
    key: str | None = None
    preemptions: int = 0
    # Images in the prompt (a vision-language model's), and the prompt tokens they take.
    images: int = 0
    image_tokens: int = 0
    # Speculative decoding: tokens drafted for the row, and accepted.
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True)
class WaitingRequest:
    id: str
    api: str
    lane: str
    received_at: float
    prompt_tokens: int
    projected_kv_bytes: int
    waiting_for: str
    priority: str = "normal"
    key: str | None = None
    # Preempted: it ran, yielded to a more urgent request, and resumes from its kept cache.
    preempted: bool = False


@dataclass(frozen=True)
class PreemptionEvent:
    """A running row that yielded to a more urgent one ([scheduling] preempt)."""

    at: float
    lane: str
    request_id: str
    key: str | None
    priority: str
    generated_tokens: int
    by_request_id: str
    by_priority: str


@dataclass(frozen=True)
class BatchState:
    configured: int
    batched: bool
    active_rows: int
    pending_rows: int
    prefilling_rows: int
    kv_bytes: int
    kv_projected_bytes: int
    kv_budget_bytes: int
    kv_budget_auto: bool
    max_active_rows_seen: int
    max_kv_bytes_seen: int
    admission_paused: str | None
    # Speculative decoding: the mode in effect, the last step's depth, the measured acceptance.
    spec_mode: str = "off"
    spec_depth: int = 0
    spec_acceptance: float = 0.0
    # The draft model's or MTP head's per-row caches (counted in kv_bytes).
    spec_cache_bytes: int = 0
    # The loaded model's KV quantization (0: off) and its KV bytes per token of context.
    kv_bits: int = 0
    kv_bytes_per_token: int = 0
    # With kv_bits: the same in the model's dtype (0 when kv_bits is off).
    kv_unquantized_bytes_per_token: int = 0


@dataclass(frozen=True)
class PromptCacheState:
    entries: int
    bytes: int
    max_bytes: int
    max_entries: int
    hits: int
    misses: int
    cached_tokens_served: int
    # Prompt tokens admitted rows took from each tier (counted at admission).
    ram_tokens: int = 0
    disk_tokens: int = 0
    # Caches kept at a prompt's boundaries (system prefix, every checkpoint_every, prompt end).
    checkpoints: int = 0
    # The disk tier: "on", "off" (configured off, or a cluster), "failed" (turned off by an error).
    disk_state: str = "off"
    disk_error: str | None = None
    disk_dir: str | None = None
    disk_bytes: int = 0
    disk_max_bytes: int = 0
    disk_entries: int = 0
    disk_writes: int = 0
    disk_hits: int = 0
    disk_corrupt: int = 0
    disk_write_errors: int = 0
    # [prompt_cache] volatile_rules applied to admitted requests, by rule name.
    rules: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RecentLookup:
    """One admitted request's prompt-cache lookup, kept for /stats and the dashboard.

    ``lookup.before``/``after`` are prompt text: admins only. The snapshot
    keeps these outside :meth:`Snapshot.as_dict`, so nothing shows them
    unless a route chooses to.
    """

    request_id: str
    model: str
    api: str
    at: float
    lookup: CacheLookup
    # The [prompt_cache] volatile_rules that changed the request's prompt.
    rules: tuple[str, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    started_at: float
    state: str  # "starting" | "ready" | "stopping" | "stopped" | "failed"
    model: ServedModel
    mode: str
    batch: BatchState
    rows: tuple[RunningRow, ...]
    pending: tuple[WaitingRequest, ...]
    drains: tuple[DrainEvent, ...]
    prompt_cache: PromptCacheState
    counters: dict[str, Any]
    throughput: dict[str, Any]
    runtime: dict[str, Any]
    last_step_at: float
    last_error: str | None = None
    busy: bool = False
    last_error_at: float | None = None
    # MLX allocator bytes (active, peak, cache) as of this snapshot; {} before the model.
    memory: dict[str, int] = field(default_factory=dict)
    # Per time bucket: the most KV bytes and waiting requests seen (sparklines).
    history: dict[str, Any] = field(default_factory=dict)
    # The cluster section (docs/cluster.md); None on a single machine.
    cluster: ClusterStatus | None = None
    # Why admission is stalled: a request refused on an idle lane (mlxd.engine.policy.stalls).
    stall: str | None = None
    # The last prompt-cache lookups, newest first; prompt text, so not in as_dict.
    lookups: tuple[RecentLookup, ...] = ()
    # The last preemptions, newest first.
    preemptions: tuple[PreemptionEvent, ...] = ()

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        """The JSON shape of ``GET /stats`` (docs/api.md); ``lookups`` is left out."""
        now = time.time() if now is None else now
        out = asdict(self)
        del out["stall"]
        del out["lookups"]
        out["uptime_s"] = round(now - self.started_at, 3)
        out["stalled"] = self.stalled(now)
        out["stalled_reason"] = self.stalled_reason(now)
        for row in out["rows"]:
            row["age_s"] = round(now - row["received_at"], 3)
        for item in out["pending"]:
            item["waited_s"] = round(now - item["received_at"], 3)
        return out

    def stalled(self, now: float, after_s: float = STEP_STALL_S) -> bool:
        """True when there is work but the engine has not finished a step for ``after_s``,
        or admission refuses a request on an idle lane (see ``stalled_reason``)."""
        return self.stalled_reason(now, after_s) is not None

    def stalled_reason(self, now: float, after_s: float = STEP_STALL_S) -> str | None:
        """Why the engine counts as stalled, or None."""
        if self.busy and now - self.last_step_at > after_s:
            return f"no step finished for {now - self.last_step_at:.0f}s while there is work"
        return self.stall
