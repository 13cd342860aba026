"""``GET /metrics``: Prometheus text format, one registry per app.

Two sources, on purpose:

- Everything the snapshot already counts (rows, KV bytes, prompt cache,
  counters, config version, uptime) is read from each loaded chat model's
  engine snapshot *at scrape time* by :class:`SnapshotCollector`, one series
  per model (label ``model``), so ``/metrics`` and ``/stats`` can never
  disagree and nothing is counted twice. The memory budget and every
  configured model's place in it come from the fleet's view
  (:class:`FleetCollector`); fleet events (loads, evictions...) are counted
  as new ones appear in the fleet's event log.
- Latency histograms (queue wait, time to first token, inter-token latency,
  request duration) need
  every request, not a sample: they are observed from ``Finished.timings``
  through ``AppState.observers`` when each accepted request ends, labelled
  with the model that served it and the lane. Drain
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
    Counter,
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
from mlxd.api.ops.recent import inter_token_s
from mlxd.api.ops.stats import NO_STORE, read_guard
from mlxd.api.state import AppState, Mlxd, provide_app_state
from mlxd.engine import MODEL_STATES, ClusterView, Finished, FleetView, ModelState

if TYPE_CHECKING:
    from mlxd.engine import Accepted, Failed, Snapshot

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
    """Gauges and counters read from each loaded chat model's snapshot, once per scrape.

    Every series carries ``model`` (the registry id); a model that is not
    loaded has no series. The runtime info and the cluster's series are the
    daemon's, read from the default model's snapshot.
    """

    def __init__(
        self, snapshots: Callable[[], dict[str, Snapshot]], primary: Callable[[], Snapshot]
    ):
        self._snapshots = snapshots
        self._primary = primary

    def describe(self) -> list[Metric]:
        return []  # the names are fixed: no need to collect at registration

    def collect(self) -> Iterator[Metric]:
        snaps = sorted(self._snapshots().items())
        primary = self._primary()
        yield from _info_metrics(snaps, primary)
        label = ["model"]
        for name, doc, read in GAUGES:
            family = GaugeMetricFamily(name, doc, labels=label)
            for model, snap in snaps:
                family.add_metric([model], read(snap))
            yield family
        for name, doc, read in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=label)
            for model, snap in snaps:
                family.add_metric([model], read(snap))
            yield family
        state = GaugeMetricFamily(
            "mlxd_engine_state", "1 for the engine's state.", labels=["model", "state"]
        )
        for model, snap in snaps:
            for name in STATES:
                state.add_metric([model, name], float(snap.state == name))
        yield state
        requests = CounterMetricFamily(
            "mlxd_requests",
            "Accepted requests that ended, by lane and outcome.",
            labels=["model", "lane", "outcome"],
        )
        for model, snap in snaps:
            for lane in LANES:
                for outcome in OUTCOMES:
                    n = snap.counters["requests"][lane][outcome]
                    requests.add_metric([model, lane, outcome], n)
        yield requests
        for name, doc, key, key_label in LABELED_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model", key_label])
            for model, snap in snaps:
                for value, n in sorted(snap.counters[key].items()):
                    family.add_metric([model, value], n)
            yield family
        if primary.cluster is not None:
            yield from _cluster_metrics(primary.cluster)


# (name, help, value from a ModelState): one series per configured model.
ModelReader = Callable[["ModelState"], float]

MODEL_GAUGES: tuple[tuple[str, str, ModelReader], ...] = (
    ("mlxd_model_loaded", "1 while the model is loaded (ready to serve), 0 otherwise.",
     lambda m: float(m.state == "loaded")),
    ("mlxd_model_pinned", "1 for a pinned model (never unloaded).", lambda m: float(m.pinned)),
    ("mlxd_model_weights_bytes", "Bytes of weights the model holds in the memory budget.",
     lambda m: m.weights_bytes),
    ("mlxd_model_reserved_bytes",
     "Bytes the model holds in the budget besides KV: weights plus its prompt-cache cap.",
     lambda m: m.reserved_bytes),
    ("mlxd_model_kv_bytes", "KV bytes the model holds in the memory budget.",
     lambda m: m.kv_bytes),
    ("mlxd_model_active_requests", "Requests holding the model (waiting, queued or running).",
     lambda m: m.active),
    ("mlxd_model_waiting_requests", "Requests waiting for the model to load.",
     lambda m: m.waiting),
    ("mlxd_model_load_seconds", "How long the model's last load took (0 before one).",
     lambda m: m.load_seconds or 0.0),
)  # fmt: skip


class FleetCollector(Collector):
    """The memory budget and every configured model's place in it, once per scrape."""

    def __init__(self, view: Callable[[], FleetView]):
        self._view = view

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        yield GaugeMetricFamily(
            "mlxd_memory_budget_bytes",
            "Bytes every model shares ([memory] budget): weights, KV and prompt caches.",
            value=view.budget_bytes,
        )
        yield GaugeMetricFamily(
            "mlxd_memory_used_bytes", "Bytes of the memory budget held now.", value=view.used_bytes
        )
        yield GaugeMetricFamily(
            "mlxd_memory_queue_length",
            "Model loads waiting for memory.",
            value=len(view.memory_queue),
        )
        models = sorted(view.models, key=lambda m: m.id)
        for name, doc, read in MODEL_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model"])
            for m in models:
                family.add_metric([m.id], read(m))
            yield family
        state = GaugeMetricFamily(
            "mlxd_model_state",
            "1 for the model's state, 0 for the others.",
            labels=["model", "state"],
        )
        for m in models:
            for name in MODEL_STATES:
                state.add_metric([m.id, name], float(m.state == name))
        yield state
        yield from _embedding_metrics(models)


# Counters of a loaded embedding model's engine (EmbeddingSnapshot), since its load.
EMBEDDING_COUNTERS = (
    ("mlxd_embedding_inputs", "Inputs embedded (strings or token lists).", "inputs_embedded"),
    ("mlxd_embedding_tokens", "Tokens embedded, special tokens included.", "tokens_embedded"),
    ("mlxd_embedding_forward_passes", "Forward passes run.", "forward_passes"),
)


def _embedding_metrics(models: list[ModelState]) -> Iterator[Metric]:
    """Each loaded embedding model's counts; the families are there (empty) without one."""
    loaded = [m for m in models if m.kind == "embedding" and m.engine]
    requests = CounterMetricFamily(
        "mlxd_embedding_requests",
        "Embedding requests answered with vectors (served) or refused and failed (failed).",
        labels=["model", "outcome"],
    )
    for m in loaded:
        requests.add_metric([m.id, "served"], m.engine.get("requests_served", 0))
        requests.add_metric([m.id, "failed"], m.engine.get("requests_failed", 0))
    yield requests
    for name, doc, key in EMBEDDING_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["model"])
        for m in loaded:
            family.add_metric([m.id], m.engine.get(key, 0))
        yield family
    for name, doc, key in (
        ("mlxd_embedding_queued_requests", "Requests waiting to be embedded.", "queued"),
        ("mlxd_embedding_last_batch_size", "Inputs in the latest forward pass.", "last_batch_size"),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["model"])
        for m in loaded:
            gauge.add_metric([m.id], m.engine.get(key, 0))
        yield gauge


def _cluster_metrics(cluster: ClusterView) -> Iterator[Metric]:
    """Only in a cluster (docs/cluster.md, "Metrics"): per-rank series carry ``rank``."""
    info = InfoMetricFamily("mlxd_cluster", "The cluster this rank 0 leads (always 1).")
    info.add_metric(
        [],
        {
            "backend": str(cluster.backend),
            "sharding": str(cluster.sharding),
            "world_size": str(cluster.world_size),
            "state": str(cluster.state),
        },
    )
    yield info
    yield GaugeMetricFamily(
        "mlxd_cluster_ready", "1 while every rank is in step.", value=cluster.state == "ready"
    )
    for name, doc, value in (
        ("mlxd_cluster_plans", "Step plans rank 0 broadcast (steps and heartbeats).",
         cluster.plans),
        ("mlxd_cluster_steps", "Model steps every rank ran in lockstep.", cluster.steps),
        ("mlxd_cluster_plan_bytes", "Bytes of step plans broadcast.", cluster.plan_bytes),
        ("mlxd_cluster_comm_seconds", "Rank 0's time in plan and digest collectives.",
         cluster.comm_seconds),
    ):  # fmt: skip
        yield CounterMetricFamily(name, doc, value=value)
    labels = ["rank", "host"]
    active = GaugeMetricFamily(
        "mlxd_cluster_rank_active_memory_bytes", "MLX active memory per rank.", labels=labels
    )
    peak = GaugeMetricFamily(
        "mlxd_cluster_rank_peak_memory_bytes", "MLX peak memory per rank.", labels=labels
    )
    age = GaugeMetricFamily(
        "mlxd_cluster_rank_heartbeat_age_seconds",
        "Seconds since rank 0 last heard the rank.",
        labels=labels,
    )
    for rank in cluster.ranks:
        values = [str(rank.rank), str(rank.host or "")]
        active.add_metric(values, rank.active_memory_bytes)
        peak.add_metric(values, rank.peak_memory_bytes)
        age.add_metric(values, rank.last_heartbeat_age_s or 0)
    yield from (active, peak, age)


def _info_metrics(snaps: list[tuple[str, Snapshot]], primary: Snapshot) -> Iterator[Metric]:
    info = InfoMetricFamily("mlxd_model", "Each loaded chat model (the value is always 1).")
    for model_id, snap in snaps:
        model = snap.model
        info.add_metric(
            [],
            {
                "model": model_id,
                "name": model.name or "",
                "family": model.family or "",
                "context_length": str(model.context or ""),
                "batchable": str(model.batchable).lower(),
                "status": model.status,
                "mode": snap.mode,
            },
        )
    yield info
    runtime = primary.runtime
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
    """One app's registry: the snapshot and fleet collectors plus the request histograms."""

    def __init__(self, state: AppState):
        self._state = state
        self._lock = threading.Lock()
        # Per model: the id of the last closed drain observed.
        self._drains_seen: dict[str, int] = {}
        # The fleet events already counted (the fleet keeps the last 100).
        self._events_seen: dict[tuple[str, str], int] = {}
        # ``*_created`` series double the histogram series for no use here.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(self.snapshots, self._primary))
        self.registry.register(FleetCollector(state.fleet.view))
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
            ["model"],
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
        self.model_events = Counter(
            "mlxd_model_events",
            "Fleet events by model and kind: loaded, load_failed, unloaded (by an admin), "
            "evicted (for memory), idle (keep_alive), removed, added, pinned, unpinned.",
            ["model", "kind"],
            registry=self.registry,
        )
        # Export zeros for the configured chat models before their first request.
        for m in state.fleet.view().models:
            if m.kind == "chat":
                self._zeros(m.id)

    def snapshots(self) -> dict[str, Snapshot]:
        """The engine snapshot of each loaded chat model, by id."""
        fleet = self._state.fleet
        loaded = {m.id for m in fleet.view().models if m.state == "loaded"}
        return {i: snap for i, snap in fleet.snapshots().items() if i in loaded}

    def _primary(self) -> Snapshot:
        return self._state.engine.snapshot()

    def observe_compile(self, seconds: float, cached: bool) -> None:
        """``AppState`` compile observer: one grammar prepared for a request."""
        self.compile.labels("hit" if cached else "cold").observe(max(seconds, 0.0))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model", "lane"], buckets=buckets, registry=self.registry)

    def _zeros(self, model: str) -> None:
        for histogram in (self.queue_wait, self.ttft, self.latency, self.itl):
            for lane in LANES:  # export zeros before the first request, for dashboards
                histogram.labels(model, lane)

    def observe(self, accepted: Accepted, outcome: Finished | Failed) -> None:
        """``AppState`` observer: record a completed request's timings."""
        if not isinstance(outcome, Finished):
            return
        t = outcome.timings
        labels = (accepted.model, accepted.lane)
        self.queue_wait.labels(*labels).observe(max(t.queue_s, 0.0))
        self.latency.labels(*labels).observe(max(t.total_s, 0.0))
        if t.ttft_s is not None:
            self.ttft.labels(*labels).observe(max(t.ttft_s, 0.0))
        itl = inter_token_s(outcome)
        if itl is not None:
            self.itl.labels(*labels).observe(itl)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything, as of now."""
        with self._lock:
            for model, snap in self.snapshots().items():
                self._observe_drains(model, snap)
            self._count_events(self._state.fleet.view())
            return generate_latest(self.registry)

    def _observe_drains(self, model: str, snap: Snapshot) -> None:
        seen = self._drains_seen.get(model, 0)
        closed = [d for d in snap.drains if d.ended_at is not None and d.id > seen]
        for event in sorted(closed, key=lambda d: d.id):
            self.drain.labels(model).observe(event.paused_s or 0.0)
            self._drains_seen[model] = event.id

    def _count_events(self, view: FleetView) -> None:
        """Add the fleet events counted since the last scrape."""
        for model, kind, total in view.event_totals:
            seen = self._events_seen.get((model, kind), 0)
            if total > seen:
                self.model_events.labels(model, kind).inc(total - seen)
                self._events_seen[(model, kind)] = total


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
            metrics = Metrics(state)
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
