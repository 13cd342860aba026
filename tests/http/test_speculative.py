"""Speculative decoding seen from outside: a per-model mode switched on by a reload,
the same text as before, its counters in /stats and /metrics; a draft model swapped in."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from mlxd.engine.policy.spec_depth import StepCosts
from tests.support.daemon import toml_config
from tests.support.tinymodels import tiny_model_dir

PROMPT = "one two three four one two three four one two three four one two"


@pytest.fixture(autouse=True)
def formula_costs(monkeypatch):
    """The cost model's formula only: step times measured on a shared CPU would vary."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, rows, width: None)


def config(mode: str, **more: Any) -> str:
    spec: dict[str, Any] = {"mode": mode, "ngram_min": 1, "saturation_tokens": 100_000, **more}
    entry = {"path": str(tiny_model_dir("llama")), "speculative": spec}
    return toml_config(models={"tiny": entry}, batch={"size": 4, "kv_budget": "64MiB"})


def complete(url: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_reloads_turn_prompt_lookup_then_a_draft_model_on(apps):
    daemon = apps.get(config("off"), name="speculative")
    before = complete(daemon.url)
    engine = daemon.stats()
    assert engine["batch"]["spec_mode"] == "off"
    assert engine["counters"]["spec_verify_steps"] == 0
    daemon.write_config(config("prompt_lookup"))
    assert daemon.reload().json()["outcome"] == "applied"
    assert complete(daemon.url) == before
    stats = daemon.stats()
    counters = stats["counters"]
    assert stats["batch"]["spec_mode"] == "prompt_lookup"
    assert counters["spec_drafted_tokens"] >= counters["spec_accepted_tokens"] >= 0
    assert counters["spec_verify_steps"] > 0
    metrics = httpx.get(f"{daemon.url}/metrics", timeout=10).text
    drafted = (
        f'mlxd_spec_drafted_tokens_total{{model="tiny"}} {float(counters["spec_drafted_tokens"])}'
    )
    assert drafted in metrics
    assert 'mlxd_spec_accepted_tokens_total{model="tiny"}' in metrics

    # A draft model loads with its target: the reload swaps the model, its weights count.
    weights = stats["model"]["weights_bytes"]
    daemon.write_config(config("draft", draft_model=str(tiny_model_dir("llama"))))
    assert daemon.reload().json()["outcome"] == "applied"
    assert complete(daemon.url) == before
    stats = daemon.stats()
    assert stats["model"]["weights_bytes"] == 2 * weights
    assert stats["batch"]["spec_mode"] == "draft"
    drafted = stats["counters"]["spec_drafted_tokens"] - counters["spec_drafted_tokens"]
    accepted = stats["counters"]["spec_accepted_tokens"] - counters["spec_accepted_tokens"]
    assert accepted >= 0.8 * drafted > 0
