"""``/metrics`` series of the fleet: the memory budget and every configured model in it.

Read from the fleet's view at scrape time; a loaded embedding model's counts
come from its engine's numbers in that view. Every metric is documented in
docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlxd.engine import MODEL_STATES, FleetStatus, ModelState

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

    def __init__(self, status: Callable[[], FleetStatus]):
        self._status = status

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        view = self._status()
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
        yield _speech_seconds(models)


# Counters of a loaded embedding model's engine (EmbeddingSnapshot), since its load.
EMBEDDING_COUNTERS = (
    ("mlxd_embedding_inputs", "Inputs embedded (strings or token lists).", "inputs_embedded"),
    ("mlxd_embedding_tokens", "Tokens embedded, special tokens included.", "tokens_embedded"),
    ("mlxd_embedding_forward_passes", "Forward passes run.", "forward_passes"),
)


# A reranker's, a transcription model's and a speech model's engines count in the same
# families (for a transcription model: inputs = uploads, tokens = tokens generated, passes
# = model calls; for a speech model: texts spoken, audio tokens, segments).
EMBEDDING_KINDS = ("embedding", "rerank", "transcription", "speech")


def _embedding_metrics(models: list[ModelState]) -> Iterator[Metric]:
    """Each loaded embedding model's counts; the families are there (empty) without one."""
    loaded = [m for m in models if m.kind in EMBEDDING_KINDS and m.engine]
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


def _speech_seconds(models: list[ModelState]) -> Metric:
    """Seconds of audio each loaded speech model has made (kind = "speech")."""
    family = CounterMetricFamily(
        "mlxd_speech_audio_seconds",
        "Seconds of audio a speech model has generated (/v1/audio/speech), before speed.",
        labels=["model"],
    )
    for m in models:
        if m.kind == "speech" and m.engine:
            family.add_metric([m.id], float(m.engine.get("audio_seconds", 0.0)))
    return family
