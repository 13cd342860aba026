"""``/metrics`` series of the Batch API: lines answered, lines waiting, open batches.

Read from the runner at scrape time (docs/metrics.md, "Batch API").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class BatchCollector(Collector):
    """The Batch API's numbers; nothing while it is off (``service()`` returns None)."""

    def __init__(self, service: Callable[[], Any]):
        self._service = service

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        batches = self._service()
        if batches is None or batches.error is not None:
            return
        runner = batches.runner
        lines = CounterMetricFamily(
            "mlxd_batch_lines",
            "Batch lines answered since start, by outcome: completed (2xx) or failed.",
            labels=["outcome"],
        )
        lines.add_metric(["completed"], runner.lines_done)
        lines.add_metric(["failed"], runner.lines_failed)
        yield lines
        yield GaugeMetricFamily(
            "mlxd_batch_queued_lines",
            "Lines of open batches not answered yet (waiting or running).",
            value=runner.queued_lines(),
        )
        yield GaugeMetricFamily(
            "mlxd_batch_running_lines",
            "Batch lines in the engines now.",
            value=runner.running_lines(),
        )
        yield GaugeMetricFamily(
            "mlxd_batches_open", "Batches not finished yet.", value=len(runner.jobs)
        )
