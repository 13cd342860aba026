"""``GET /metrics``: Prometheus text format, one registry per app.

Two sources, on purpose:

- Everything the snapshot already counts (rows, KV bytes, prompt cache,
  counters, uptime) is read from each loaded chat model's engine snapshot
  *at scrape time*, with the daemon's config version
  (:class:`~mlxd.api.ops.engine_metrics.SnapshotCollector`), one series per
  model (label ``model``), so ``/metrics`` and ``/stats`` can never disagree
  and nothing is counted twice. The memory budget and every configured
  model's place in it come from the fleet's view
  (:class:`~mlxd.api.ops.fleet_metrics.FleetCollector`); fleet events (loads,
  evictions...) are counted as new ones appear in the fleet's event log.
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
import weakref
from typing import TYPE_CHECKING

from litestar import Controller, Response, get
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from mlxd.api.batches.metrics import BatchCollector
from mlxd.api.ops.engine_metrics import LANES, SnapshotCollector
from mlxd.api.ops.fleet_metrics import FleetCollector
from mlxd.api.ops.key_metrics import KeyCollector
from mlxd.api.ops.recent import inter_token_s
from mlxd.api.ops.stats import NO_STORE, read_guard
from mlxd.api.ops.who import keys_stats
from mlxd.api.state import AppState, Mlxd
from mlxd.engine import Finished, FleetStatus

if TYPE_CHECKING:
    from mlxd.engine import Accepted, Failed, Snapshot

TEXT_FORMAT = "text/plain; version=0.0.4"

QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)
DRAIN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
COMPILE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)


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
        self.registry.register(
            SnapshotCollector(self.snapshots, self._primary, lambda: state.reload_log.config)
        )
        self.registry.register(FleetCollector(state.fleet.status))
        self.registry.register(BatchCollector(lambda: state.batches))
        self.registry.register(KeyCollector(lambda: keys_stats(state)))
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
        for m in state.fleet.status().models:
            if m.kind == "chat":
                self._zeros(m.id)

    def snapshots(self) -> dict[str, Snapshot]:
        """The engine snapshot of each loaded chat model, by id."""
        fleet = self._state.fleet
        loaded = {m.id for m in fleet.status().models if m.state == "loaded"}
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
            self._count_events(self._state.fleet.status())
            return generate_latest(self.registry)

    def _observe_drains(self, model: str, snap: Snapshot) -> None:
        seen = self._drains_seen.get(model, 0)
        closed = [d for d in snap.drains if d.ended_at is not None and d.id > seen]
        for event in sorted(closed, key=lambda d: d.id):
            self.drain.labels(model).observe(event.paused_s or 0.0)
            self._drains_seen[model] = event.id

    def _count_events(self, view: FleetStatus) -> None:
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

    @get("/")
    async def metrics(self, mlxd: Mlxd) -> Response[bytes]:
        """Prometheus text format (docs/metrics.md)."""
        body = install_metrics(mlxd).render()
        # The classic text format (what generate_latest writes); Litestar adds the charset.
        return Response(body, media_type=TEXT_FORMAT, headers=NO_STORE)
