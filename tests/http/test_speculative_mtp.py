"""``mode = "mtp"`` from outside: a reload loads the MTP head with its model, the text is
the same, its bytes count; a model without an MTP head is refused by the reload, naming it,
and keeps serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.engine.policy.spec_depth import StepCosts
from tests.support.daemon import toml_config
from tests.support.tinymtp import tiny_mtp_dir

PROMPT = "The river runs past the old mill."


@pytest.fixture(autouse=True)
def formula_costs(monkeypatch):
    """The cost model's formula only: step times measured on a shared CPU would vary."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, rows, width: None)


def config(mode: str, path: Path) -> str:
    spec: dict[str, Any] = {"mode": mode, "saturation_tokens": 100_000}
    entry = {"path": str(path), "speculative": spec}
    return toml_config(models={"glm": entry}, batch={"size": 4, "kv_budget": "64MiB"})


def complete(url: str) -> str:
    body = {"model": "glm", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_reload_loads_the_mtp_head_and_one_without_it_is_refused(apps):
    echo = tiny_mtp_dir(echo=True)
    daemon = apps.get(config("off", echo), name="mtp")
    before = complete(daemon.url)
    weights = daemon.stats()["model"]["weights_bytes"]

    daemon.write_config(config("mtp", echo))
    assert daemon.reload().json()["outcome"] == "applied"
    assert complete(daemon.url) == before
    stats = daemon.stats()
    assert stats["batch"]["spec_mode"] == "mtp"
    assert stats["model"]["weights_bytes"] > weights
    counters = stats["counters"]
    assert counters["spec_accepted_tokens"] >= 0.8 * counters["spec_drafted_tokens"] > 0

    bare = tiny_mtp_dir(with_mtp=False)
    daemon.write_config(config("mtp", bare))
    answer = daemon.reload().json()
    assert answer["outcome"] in ("failed", "partial"), answer
    assert "has no MTP weights" in answer["error"] and bare.name in answer["error"], answer
    assert complete(daemon.url) == before  # the previous model keeps serving
