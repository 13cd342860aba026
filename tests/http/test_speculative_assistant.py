"""A Gemma 4 assistant from outside: a reload loads it with its target, the text is the same,
its bytes count; an assistant for another target is refused by the reload, naming it, and the
previous model keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from mlxd.engine.policy.spec_depth import StepCosts
from tests.support.daemon import toml_config
from tests.support.tinygemma4 import tiny_assistant_dir, tiny_gemma4_dir

PROMPT = "The river runs past the old mill."


@pytest.fixture(autouse=True)
def formula_costs(monkeypatch):
    """The cost model's formula only: step times measured on a shared CPU would vary."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, rows, width: None)


def config(mode: str, assistant: Path | None = None) -> str:
    spec: dict = {"mode": mode, "saturation_tokens": 100_000}
    if assistant is not None:
        spec["draft_model"] = str(assistant)
    entry = {"path": str(tiny_gemma4_dir(echo=True)), "speculative": spec}
    return toml_config(models={"gemma": entry}, batch={"size": 4, "kv_budget": "64MiB"})


def complete(url: str) -> str:
    body = {"model": "gemma", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_reload_loads_the_assistant_and_a_mismatched_one_is_refused(apps, tmp_path):
    daemon = apps.get(config("off"), name="gemma4-assistant")
    before = complete(daemon.url)
    weights = daemon.stats()["model"]["weights_bytes"]

    daemon.write_config(config("draft", tiny_assistant_dir(echo=True)))
    assert daemon.reload().json()["outcome"] == "applied"
    assert complete(daemon.url) == before
    stats = daemon.stats()
    assert stats["batch"]["spec_mode"] == "draft"
    assert stats["model"]["weights_bytes"] > weights
    counters = stats["counters"]
    assert counters["spec_accepted_tokens"] >= 0.8 * counters["spec_drafted_tokens"] > 0

    other = tmp_path / "assistant-for-another-size"
    shutil.copytree(tiny_assistant_dir(echo=True), other)
    spec = json.loads((other / "config.json").read_text())
    spec["backbone_hidden_size"] = 128
    (other / "config.json").write_text(json.dumps(spec))
    daemon.write_config(config("draft", other))
    answer = daemon.reload().json()
    assert answer["outcome"] in ("failed", "partial"), answer
    assert "hidden size 128" in answer["error"] and other.name in answer["error"], answer
    assert complete(daemon.url) == before  # the previous model keeps serving
