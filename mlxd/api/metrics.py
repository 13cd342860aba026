"""``GET /metrics``: Prometheus text format, one registry per app.

Two sources, on purpose:

- Everything the snapshot already counts (rows, KV bytes, prompt cache,
  counters, config version, uptime) is read from the engine snapshot *at
  scrape time* by :class:`SnapshotCollector`, so ``/metrics`` and ``/stats``
  can never disagree and nothing is counted twice.
- Latency histograms (queue wait, time to first token, inter-token latency,
  request duration) need
  every request, not a sample: they are observed from ``Finished.timings``
  through ``AppState.observers`` when each accepted request ends. Drain
  durations are observed from the snapshot's drain ring buffer as new closed
  drains appear.

Every metric is documented in docs/metrics.md.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from litestar import Controller, Response, get
from litestar.di import Provide
from prometheus_client import (
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mlxd import __version__
from mlxd.api.recent import inter_token_s
from mlxd.api.state import AppState, Mlxd, provide_app_state
from mlxd.api.stats import NO_STORE, read_guard
from mlxd.engine.messages import Finished

if TYPE_CHECKING:
    from mlxd.engine.messages import Accepted, Failed
    from mlxd.engine.snapshot import Snapshot

TEXT_FORMAT = "text/plain; version=0.0.4"
LANES = ("batch", "serial")
OUTCOMES = ("completed", "cancelled", "failed")

QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)
DRAIN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
COMPILE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)


# (name, help, value from the snapshot): plain gauges and counters.
Reader = Callable[["Snapshot"], float]

GAUGES: tuple[tuple[str, str, Reader], ...] = (
    ("mlxd_uptime_seconds", "Seconds since the engine started.",
     lambda s: time.time() - s.started_at),
    ("mlxd_start_time_seconds", "Unix time the engine started.", lambda s: s.started_at),
    ("mlxd_engine_stalled", "1 when there is work but no step finished for 60 s.",
     lambda s: float(s.stalled(time.time()))),
    ("mlxd_config_version", "Version of the applied config (1 at start, +1 per applied reload).",
     lambda s: s.config.version),
    ("mlxd_config_applied_timestamp_seconds", "Unix time the current config was applied.",
     lambda s: s.config.applied_at),
    ("mlxd_batch_size", "Configured batch width ([batch] size; 1 is serial mode).",
     lambda s: s.batch.configured),
    ("mlxd_requests_running", "Requests with a row in the engine (batch rows and the serial row).",
     lambda s: s.batch.active_rows),
    ("mlxd_requests_waiting", "Requests in the pending queues (batch and serial).",
     lambda s: s.batch.pending_rows),
    ("mlxd_requests_prefilling", "Running requests still prefilling their prompt.",
     lambda s: s.batch.prefilling_rows),
    ("mlxd_requests_running_peak", "Most rows running at once since start.",
     lambda s: s.batch.max_active_rows_seen),
    ("mlxd_drain_in_progress", "1 while batch admission is paused by a drain.",
     lambda s: float(s.batch.admission_paused is not None)),
    ("mlxd_throughput_tokens_per_second", "Generated tokens per second over the last minute.",
     lambda s: s.throughput.get("last_minute_tps", 0.0)),
    ("mlxd_kv_bytes", "Bytes held by the KV caches of running rows.", lambda s: s.batch.kv_bytes),
    ("mlxd_kv_projected_bytes", "KV bytes the running rows are projected to need (admission).",
     lambda s: s.batch.kv_projected_bytes),
    ("mlxd_kv_budget_bytes", "KV byte budget of the batch ([batch] kv_budget).",
     lambda s: s.batch.kv_budget_bytes),
    ("mlxd_kv_usage_ratio", "mlxd_kv_bytes / mlxd_kv_budget_bytes.",
     lambda s: _ratio(s.batch.kv_bytes, s.batch.kv_budget_bytes)),
    ("mlxd_kv_projected_usage_ratio", "mlxd_kv_projected_bytes / mlxd_kv_budget_bytes.",
     lambda s: _ratio(s.batch.kv_projected_bytes, s.batch.kv_budget_bytes)),
    ("mlxd_kv_bytes_peak", "Most KV bytes held at once since start.",
     lambda s: s.batch.max_kv_bytes_seen),
    ("mlxd_prompt_cache_bytes", "Bytes held by the prompt (prefix) cache.",
     lambda s: s.prompt_cache.bytes),
    ("mlxd_prompt_cache_max_bytes", "Byte cap of the prompt cache ([prompt_cache] max_bytes).",
     lambda s: s.prompt_cache.max_bytes),
    ("mlxd_prompt_cache_entries", "Conversations held by the prompt cache.",
     lambda s: s.prompt_cache.entries),
)  # fmt: skip

COUNTERS: tuple[tuple[str, str, Reader], ...] = (
    ("mlxd_requests_submitted", "Requests the engine accepted.", lambda s: s.counters["submitted"]),
    ("mlxd_drains", "Drains started (batch admission paused for the serial lane or a swap).",
     lambda s: max((d.id for d in s.drains), default=0)),
    ("mlxd_prompt_cache_hits", "Prompt-cache lookups that found a prefix.",
     lambda s: s.prompt_cache.hits),
    ("mlxd_prompt_cache_misses", "Prompt-cache lookups that found nothing.",
     lambda s: s.prompt_cache.misses),
    ("mlxd_prompt_tokens", "Prompt tokens of completed requests.",
     lambda s: s.counters["prompt_tokens"]),
    ("mlxd_generation_tokens", "Tokens generated by completed requests.",
     lambda s: s.counters["generated_tokens"]),
    ("mlxd_prompt_cached_tokens", "Prompt tokens of completed requests read from the prompt cache.",
     lambda s: s.counters["cached_tokens"]),
    ("mlxd_prefill_seconds", "Engine time spent prefilling prompts.",
     lambda s: s.counters["prefill_seconds"]),
    ("mlxd_decode_seconds", "Engine time spent decoding.", lambda s: s.counters["decode_seconds"]),
    ("mlxd_engine_errors", "Errors in the engine loop or in a batched step.",
     lambda s: s.counters["engine_errors"]),
    ("mlxd_tool_calls", "Tool calls sent to clients (parsed with the model's tool parser).",
     lambda s: s.counters["tool_calls"]),
    ("mlxd_tool_call_parse_failures", "Tool-call texts that did not parse (sent as content).",
     lambda s: s.counters["tool_call_parse_failures"]),
)  # fmt: skip

# (name, help, counters key, label): counters keyed by one label.
LABELED_COUNTERS = (
    ("mlxd_rejected_requests", "Requests refused before running, by reason.", "rejected", "reason"),
    ("mlxd_lane_decisions", "Accepted requests by lane reason.", "lane_reasons", "reason"),
    ("mlxd_api_requests", "Accepted requests by the API they came through.", "by_api", "api"),
    ("mlxd_constrained_rows", "Accepted requests run under a grammar, by kind (json, tools).",
     "constrained_by_kind", "kind"),
)  # fmt: skip

STATES = ("starting", "ready", "stopping", "stopped", "failed", "peer_lost")


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


class SnapshotCollector(Collector):
    """Gauges and counters read from one snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]):
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # the names are fixed: no need to collect at registration

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from _info_metrics(snap)
        for name, doc, read in GAUGES:
            yield GaugeMetricFamily(name, doc, value=read(snap))
        for name, doc, read in COUNTERS:
            yield CounterMetricFamily(name, doc, value=read(snap))
        state = GaugeMetricFamily(
            "mlxd_engine_state", "1 for the engine's state.", labels=["state"]
        )
        for name in STATES:
            state.add_metric([name], float(snap.state == name))
        yield state
        requests = CounterMetricFamily(
            "mlxd_requests",
            "Accepted requests that ended, by lane and outcome.",
            labels=["lane", "outcome"],
        )
        for lane in LANES:
            for outcome in OUTCOMES:
                requests.add_metric([lane, outcome], snap.counters["requests"][lane][outcome])
        yield requests
        for name, doc, key, label in LABELED_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, n in sorted(snap.counters[key].items()):
                family.add_metric([value], n)
            yield family
        if snap.cluster is not None:
            yield from _cluster_metrics(snap.cluster)


def _cluster_metrics(cluster: dict) -> Iterator[Metric]:
    """Only in a cluster (docs/cluster.md, "Metrics"): per-rank series carry ``rank``."""
    info = InfoMetricFamily("mlxd_cluster", "The cluster this rank 0 leads (always 1).")
    info.add_metric(
        [],
        {
            "backend": str(cluster["backend"]),
            "sharding": str(cluster["sharding"]),
            "world_size": str(cluster["world_size"]),
            "state": str(cluster["state"]),
        },
    )
    yield info
    yield GaugeMetricFamily(
        "mlxd_cluster_ready", "1 while every rank is in step.", value=cluster["state"] == "ready"
    )
    for name, doc, key in (
        ("mlxd_cluster_plans", "Step plans rank 0 broadcast (steps and heartbeats).", "plans"),
        ("mlxd_cluster_steps", "Model steps every rank ran in lockstep.", "steps"),
        ("mlxd_cluster_plan_bytes", "Bytes of step plans broadcast.", "plan_bytes"),
        ("mlxd_cluster_comm_seconds", "Rank 0's time in plan and digest collectives.",
         "comm_seconds"),
    ):  # fmt: skip
        yield CounterMetricFamily(name, doc, value=cluster[key])
    per_rank = (
        ("mlxd_cluster_rank_active_memory_bytes", "MLX active memory per rank.",
         "active_memory_bytes"),
        ("mlxd_cluster_rank_peak_memory_bytes", "MLX peak memory per rank.", "peak_memory_bytes"),
        ("mlxd_cluster_rank_heartbeat_age_seconds", "Seconds since rank 0 last heard the rank.",
         "last_heartbeat_age_s"),
    )  # fmt: skip
    for name, doc, key in per_rank:
        family = GaugeMetricFamily(name, doc, labels=["rank", "host"])
        for rank in cluster["ranks"]:
            family.add_metric([str(rank["rank"]), str(rank["host"] or "")], rank[key] or 0)
        yield family


def _info_metrics(snap: Snapshot) -> Iterator[Metric]:
    model, runtime = snap.model, snap.runtime
    info = InfoMetricFamily("mlxd_model", "The served model (the value is always 1).")
    info.add_metric(
        [],
        {
            "model": model.name or "",
            "family": model.family or "",
            "context_length": str(model.context or ""),
            "batchable": str(model.batchable).lower(),
            "status": model.status,
            "mode": snap.mode,
        },
    )
    yield info
    info = InfoMetricFamily("mlxd_runtime", "What the daemon runs on (the value is always 1).")
    info.add_metric(
        [],
        {
            "version": __version__,
            "device": str(runtime.get("device") or ""),
            "blas": str(runtime.get("blas") or ""),
            "blas_threads": str(runtime.get("blas_threads") or ""),
        },
    )
    yield info


class Metrics:
    """One app's registry: the snapshot collector plus the request histograms."""

    def __init__(self, snapshot: Callable[[], Snapshot]):
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self._drains_seen = 0
        # ``*_created`` series double the histogram series for no use here.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(snapshot))
        hist = self._histogram
        self.queue_wait = hist(
            "mlxd_queue_wait_seconds", "Arrival to admission, per completed request.", QUEUE_BUCKETS
        )
        self.ttft = hist(
            "mlxd_time_to_first_token_seconds", "Arrival to the first token.", TTFT_BUCKETS
        )
        self.latency = hist(
            "mlxd_request_duration_seconds", "Arrival to the last token.", LATENCY_BUCKETS
        )
        self.itl = hist(
            "mlxd_inter_token_latency_seconds",
            "Mean time between consecutive tokens of a request: "
            "(last token - first token) / (tokens - 1).",
            ITL_BUCKETS,
        )
        self.drain = Histogram(
            "mlxd_drain_duration_seconds",
            "How long each closed drain paused batch admission.",
            buckets=DRAIN_BUCKETS,
            registry=self.registry,
        )
        self.compile = Histogram(
            "mlxd_grammar_compile_seconds",
            "Time to get a grammar matcher for a request (cold compile or LRU copy).",
            ["cache"],
            buckets=COMPILE_BUCKETS,
            registry=self.registry,
        )
        for cache in ("cold", "hit"):
            self.compile.labels(cache)

    def observe_compile(self, seconds: float, cached: bool) -> None:
        """``AppState`` compile observer: one grammar prepared for a request."""
        self.compile.labels("hit" if cached else "cold").observe(max(seconds, 0.0))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        histogram = Histogram(name, doc, ["lane"], buckets=buckets, registry=self.registry)
        for lane in LANES:  # export zeros before the first request, for dashboards
            histogram.labels(lane)
        return histogram

    def observe(self, accepted: Accepted, outcome: Finished | Failed) -> None:
        """``AppState`` observer: record a completed request's timings."""
        if not isinstance(outcome, Finished):
            return
        t = outcome.timings
        lane = accepted.lane
        self.queue_wait.labels(lane).observe(max(t.queue_s, 0.0))
        self.latency.labels(lane).observe(max(t.total_s, 0.0))
        if t.ttft_s is not None:
            self.ttft.labels(lane).observe(max(t.ttft_s, 0.0))
        itl = inter_token_s(outcome)
        if itl is not None:
            self.itl.labels(lane).observe(itl)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything, as of now."""
        with self._lock:
            self._observe_drains(self._snapshot())
            return generate_latest(self.registry)

    def _observe_drains(self, snap: Snapshot) -> None:
        closed = [d for d in snap.drains if d.ended_at is not None and d.id > self._drains_seen]
        for event in sorted(closed, key=lambda d: d.id):
            self.drain.observe(event.paused_s or 0.0)
            self._drains_seen = event.id


_installed: weakref.WeakKeyDictionary[AppState, Metrics] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


def install_metrics(state: AppState) -> Metrics:
    """The :class:`Metrics` of ``state``, created and subscribed to its observers once.

    Call it when the app is built, so the histograms see every request; the
    ``/metrics`` handler calls it too, which is a no-op after the first time.
    """
    with _install_lock:
        metrics = _installed.get(state)
        if metrics is None:
            metrics = Metrics(state.engine.snapshot)
            state.observers.append(metrics.observe)
            state.compile_observers.append(metrics.observe_compile)
            _installed[state] = metrics
        return metrics


class MetricsController(Controller):
    path = "/metrics"
    guards = [read_guard]
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}

    @get("/")
    async def metrics(self, mlxd: Mlxd) -> Response[bytes]:
        """Prometheus text format (docs/metrics.md)."""
        body = install_metrics(mlxd).render()
        # The classic text format (what generate_latest writes); Litestar adds the charset.
        return Response(body, media_type=TEXT_FORMAT, headers=NO_STORE)
