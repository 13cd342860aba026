"""``GET /metrics`` against the real daemon: it parses, and it agrees with /stats.

The module's traffic runs before anything reads /metrics, so the latency
histograms must have been counting from the start, not from the first scrape.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT
from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

DOCS = ROOT / "docs" / "metrics.md"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def daemon(apps):
    config = toml_config(
        model={"path": str(tiny_model_dir("llama")), "name": MODEL},
        batch={"size": 2, "kv_budget": "64MiB"},
    )
    # Its own: the histograms must have counted this module's traffic from the start.
    return apps.get(config, name="metrics")


def _chat(d: Daemon, content: str, max_tokens: int, **extra: Any) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }
    return httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=120).status_code


@pytest.fixture(scope="module")
def traffic(daemon: Daemon) -> dict[str, int]:
    """Batch rows, a seeded request that drains them, and a refused request; then idle."""
    statuses: list[int] = []

    def send(*args: Any, **kw: Any) -> None:
        statuses.append(_chat(daemon, *args, **kw))

    threads = [
        threading.Thread(target=send, args=(f"metrics {i} " * 6, 300), kwargs={"stream": True})
        for i in range(3)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not any(r["lane"] == "batch" for r in daemon.stats()["rows"]):
        assert time.monotonic() < deadline, "no batch row ever ran"
        time.sleep(0.01)
    send("seeded", 30, seed=3)
    send("word " * 5000, 10)  # longer than the context: refused before it runs
    for t in threads:
        t.join()
    while daemon.stats()["busy"]:
        time.sleep(0.05)
    return {"ok": statuses.count(200), "refused": statuses.count(400)}


def scrape(d: Daemon) -> tuple[dict[str, Any], dict[tuple[str, tuple], float], str]:
    """(/stats, {(sample name, labels): value}, raw /metrics), read while idle and stable."""
    for _ in range(20):
        before = d.stats()
        response = httpx.get(f"{d.url}/metrics", timeout=10)
        after = d.stats()
        if before["counters"] == after["counters"] and before["drains"] == after["drains"]:
            break
    else:
        raise AssertionError("/stats kept changing while idle")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return after, samples, response.text


def value(samples: dict, metric: str, /, **labels: str) -> float:
    """A sample of the one model's series: every engine series carries ``model``."""
    return samples[(metric, tuple(sorted({"model": MODEL, **labels}.items())))]


def test_metrics_parse_and_agree_with_stats(daemon: Daemon, traffic: dict[str, int]) -> None:
    assert traffic == {"ok": 4, "refused": 1}
    s, m, _ = scrape(daemon)
    c, b, pc = s["counters"], s["batch"], s["prompt_cache"]
    expected = {
        "mlxd_requests_submitted_total": c["submitted"],
        "mlxd_prompt_tokens_total": c["prompt_tokens"],
        "mlxd_generation_tokens_total": c["generated_tokens"],
        "mlxd_prompt_cached_tokens_total": c["cached_tokens"],
        "mlxd_engine_errors_total": c["engine_errors"],
        "mlxd_prompt_cache_hits_total": pc["hits"],
        "mlxd_prompt_cache_misses_total": pc["misses"],
        "mlxd_prompt_cache_bytes": pc["bytes"],
        "mlxd_prompt_cache_entries": pc["entries"],
        "mlxd_prompt_cache_max_bytes": pc["max_bytes"],
        "mlxd_kv_budget_bytes": b["kv_budget_bytes"],
        "mlxd_kv_bytes": b["kv_bytes"],
        "mlxd_kv_bytes_peak": b["max_kv_bytes_seen"],
        "mlxd_requests_running": b["active_rows"],
        "mlxd_requests_waiting": b["pending_rows"],
        "mlxd_requests_prefilling": b["prefilling_rows"],
        "mlxd_requests_running_peak": b["max_active_rows_seen"],
        "mlxd_batch_size": b["configured"],
        "mlxd_config_version": s["config"]["version"],
        "mlxd_drains_total": len(s["drains"]),
    }
    for name, want in expected.items():
        assert value(m, name) == pytest.approx(want), name
    assert b["kv_budget_bytes"] == 64 * 1024**2
    assert value(m, "mlxd_kv_usage_ratio") == 0.0  # idle
    for lane, outcomes in c["requests"].items():
        for outcome, n in outcomes.items():
            assert value(m, "mlxd_requests_total", lane=lane, outcome=outcome) == n
    assert c["requests"]["batch"]["completed"] == 3 and c["requests"]["serial"]["completed"] == 1
    assert c["rejected"] == {"context_length_exceeded": 1}
    for reason, n in c["rejected"].items():
        assert value(m, "mlxd_rejected_requests_total", reason=reason) == n
    for reason, n in c["lane_reasons"].items():
        assert value(m, "mlxd_lane_decisions_total", reason=reason) == n
    assert value(m, "mlxd_drain_duration_seconds_count") == len(s["drains"]) == 1
    assert value(m, "mlxd_drain_duration_seconds_sum") == pytest.approx(s["drains"][0]["paused_s"])
    assert value(m, "mlxd_engine_state", state="ready") == 1
    # The start time is one value; uptime is read at /metrics' moment, before the
    # /stats read that follows it (seconds apart on a loaded machine).
    assert value(m, "mlxd_start_time_seconds") == pytest.approx(s["started_at"], abs=0.01)
    assert 0 < value(m, "mlxd_uptime_seconds") <= s["uptime_s"] + 0.01
    info = value(m, "mlxd_model_info", batchable="true", context_length=str(s["model"]["context"]),
                 family="llama", mode="batch", name=MODEL, status="ready")  # fmt: skip
    assert info == 1
    # An old single-[model] config is a fleet of one: loaded, pinned, in the budget.
    assert value(m, "mlxd_model_loaded") == value(m, "mlxd_model_pinned") == 1
    assert value(m, "mlxd_model_weights_bytes") > 0
    assert 0 < m[("mlxd_memory_used_bytes", ())] <= m[("mlxd_memory_budget_bytes", ())]
    assert value(m, "mlxd_model_events_total", kind="loaded") == 1


def test_histograms_count_every_completed_request(daemon: Daemon, traffic: dict) -> None:
    s, m, _ = scrape(daemon)
    for lane in ("batch", "serial"):
        completed = s["counters"]["requests"][lane]["completed"]
        for name in ("mlxd_queue_wait_seconds", "mlxd_time_to_first_token_seconds",
                     "mlxd_request_duration_seconds"):  # fmt: skip
            count = value(m, f"{name}_count", lane=lane)
            assert count == completed, (
                f"{name}{{lane={lane}}} counted {count:g} of {completed} completed requests "
                "(were the histograms installed before the first request?)"
            )
            assert value(m, f"{name}_bucket", lane=lane, le="+Inf") == completed
    # A request's total time covers its wait and its first token.
    assert value(m, "mlxd_request_duration_seconds_sum", lane="batch") >= value(
        m, "mlxd_time_to_first_token_seconds_sum", lane="batch"
    )


def test_metrics_use_their_own_registry_and_are_documented(daemon: Daemon) -> None:
    response = httpx.get(f"{daemon.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name for f in text_string_to_metric_families(response.text)}
    foreign = sorted(n for n in families if not n.startswith("mlxd_"))
    assert not foreign, f"metrics from another registry leaked in: {foreign}"
    docs = DOCS.read_text()
    documented = set(re.findall(r"^\| `(mlxd_[a-z_]+)`", docs, re.M))
    # The parser names counter families without the _total the exposition adds.
    exposed = {re.sub(r"_total$", "", n) for n in documented}
    assert families == exposed, (
        f"undocumented: {sorted(families - exposed)}; documented but absent: "
        f"{sorted(exposed - families)}"
    )
