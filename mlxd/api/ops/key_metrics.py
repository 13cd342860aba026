"""``/metrics`` series per API key (label ``key``: the key's name, never its secret).

Read at scrape time from the same value as ``/stats`` ``keys``
(:func:`mlxd.api.ops.who.keys_stats`), so the two never disagree. Request and
token counts are the daemon's (they survive a reload, not a restart);
every metric is documented in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# (name, help, /stats keys field, counter?)
SERIES: tuple[tuple[str, str, str, bool], ...] = (
    ("mlxd_key_requests", "Requests counted against the key (admitted past its quotas).",
     "requests_total", True),
    ("mlxd_key_tokens", "Prompt + generated tokens of the key's completed requests.",
     "tokens_total", True),
    ("mlxd_key_rate_limited", "The key's requests refused with 429 (rate or concurrency).",
     "refused", True),
    ("mlxd_key_preemptions", "The key's rows that yielded to a more urgent request.",
     "preemptions", True),
    ("mlxd_key_requests_running", "The key's requests running now (every chat model).",
     "running", False),
    ("mlxd_key_requests_waiting", "The key's requests waiting in a queue now.", "waiting", False),
    ("mlxd_key_tokens_last_minute", "The key's tokens over the last rolling minute.",
     "tokens_last_minute", False),
)  # fmt: skip


class KeyCollector(Collector):
    """One series per configured API key for each of :data:`SERIES`."""

    def __init__(self, read: Callable[[], list[dict[str, Any]]]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        keys = self._read()
        for name, doc, field, counter in SERIES:
            family = (
                CounterMetricFamily(name, doc, labels=["key"])
                if counter
                else GaugeMetricFamily(name, doc, labels=["key"])
            )
            for values in keys:
                family.add_metric([values["name"]], float(values[field]))
            yield family
