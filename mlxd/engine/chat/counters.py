"""The engine thread's running counts: outcomes, tokens per time bucket, KV and queue peaks.

Mutable, owned by the engine thread; each snapshot copies their ``view()``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any


class Throughput:
    """Decode tokens per time bucket, for the last few minutes."""

    def __init__(self, bucket_s: float = 5.0, buckets: int = 60):
        self.bucket_s = bucket_s
        self._buckets: deque[tuple[int, int]] = deque(maxlen=buckets)
        self._size = buckets

    def add(self, tokens: int, now: float) -> None:
        key = int(now // self.bucket_s)
        if self._buckets and self._buckets[-1][0] == key:
            self._buckets[-1] = (key, self._buckets[-1][1] + tokens)
        else:
            self._buckets.append((key, tokens))

    def rates(self, now: float) -> dict[str, Any]:
        """tok/s per bucket, oldest first, ending with the current (partial) bucket."""
        current = int(now // self.bucket_s)
        counts = dict(self._buckets)
        series = []
        for key in range(current - self._size + 1, current + 1):
            span = self.bucket_s if key < current else max(now - key * self.bucket_s, 1e-3)
            series.append(round(counts.get(key, 0) / span, 2))
        minute = int(60 / self.bucket_s)
        window = series[-minute - 1 : -1] if len(series) > minute else series[:-1]
        last_minute = sum(window) / len(window) if window else 0.0
        return {
            "bucket_s": self.bucket_s,
            "series": series,
            "last_minute_tps": round(last_minute, 2),
        }


class Peaks:
    """The largest KV bytes and queue length seen per time bucket, for the last few minutes."""

    def __init__(self, bucket_s: float = 5.0, buckets: int = 60):
        self.bucket_s = bucket_s
        self._size = buckets
        self._buckets: deque[tuple[int, int, int]] = deque(maxlen=buckets)

    def add(self, kv_bytes: int, waiting: int, now: float) -> None:
        key = int(now // self.bucket_s)
        if self._buckets and self._buckets[-1][0] == key:
            _, kv, queue = self._buckets[-1]
            self._buckets[-1] = (key, max(kv, kv_bytes), max(queue, waiting))
        else:
            self._buckets.append((key, kv_bytes, waiting))

    def history(self, now: float) -> dict[str, Any]:
        """Oldest first, ending with the current bucket; 0 where nothing was seen."""
        current = int(now // self.bucket_s)
        seen = {key: (kv, queue) for key, kv, queue in self._buckets}
        keys = range(current - self._size + 1, current + 1)
        return {
            "bucket_s": self.bucket_s,
            "kv_bytes": [seen.get(k, (0, 0))[0] for k in keys],
            "waiting": [seen.get(k, (0, 0))[1] for k in keys],
        }


@dataclass
class Counters:
    """Monotonic counts, owned by the engine thread; copied into each snapshot."""

    submitted: int = 0
    requests: dict[str, dict[str, int]] = field(
        default_factory=lambda: {
            lane: {"completed": 0, "cancelled": 0, "failed": 0} for lane in ("batch", "serial")
        }
    )
    lane_reasons: dict[str, int] = field(default_factory=dict)
    # Accepted requests by the API they came through (chat, completions, responses, messages).
    by_api: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    engine_errors: int = 0
    # Steps that ended with more KV bytes than the budget (rows past their decode allowance).
    kv_over_budget_steps: int = 0
    # Rows run under a grammar, by kind (json, tools); tool calls sent and
    # calls whose text did not parse (sent as content instead).
    constrained_rows: dict[str, int] = field(default_factory=dict)
    tool_calls: int = 0
    tool_call_parse_failures: int = 0
    # Rows that yielded to a more urgent request ([scheduling] preempt), by API key
    # name ("" without keys); and preempted rows admitted again.
    preemptions: int = 0
    preemptions_by_key: dict[str, int] = field(default_factory=dict)
    resumed: int = 0
    # Images in completed requests' prompts, and the engine time their vision tower took
    # (0 for images whose tokens came from the prompt cache).
    images: int = 0
    vision_seconds: float = 0.0
    # Speculative decoding ([speculative]): tokens drafted and verified, drafted tokens
    # accepted (each accepted one is a forward saved), and verify steps run.
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0

    def outcome(self, lane: str, outcome: str) -> None:
        self.requests[lane][outcome] += 1

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["constrained_rows"] = sum(self.constrained_rows.values())
        out["constrained_by_kind"] = dict(self.constrained_rows)
        out["finished"] = sum(sum(v.values()) for v in self.requests.values())
        out["prefill_seconds"] = round(self.prefill_seconds, 3)
        out["decode_seconds"] = round(self.decode_seconds, 3)
        out["vision_seconds"] = round(self.vision_seconds, 6)
        return out
