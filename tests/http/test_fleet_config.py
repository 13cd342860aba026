"""An unloaded default chat model as the dashboard shows it, and a ``[memory] budget``
that can never hold it (issue 33 items 6 and 5).

The budget is kept (the file is what the operator asked for), but ``/ready``
answers 503 with the numbers, the reload warns, and ``/stats`` says it, until
the budget is raised.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.daemon import toml_config


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    return apps.get(_config(tiny_models, "auto"), name="fleet-config")


def _config(tiny_models, budget: str) -> str:
    return toml_config(
        memory={"budget": budget},
        models={"tiny": {"path": str(tiny_models("llama"))}},
    )


def test_the_status_bar_names_an_unloaded_default_model(daemon):
    """Issue 33 item 6, as served: not "(no model)", not "model cannot batch: serial"."""
    assert {m["id"]: m["state"] for m in daemon.stats()["fleet"]["models"]} == {"tiny": "unloaded"}
    html = httpx.get(f"{daemon.url}/dashboard/status-bar").text
    assert "<h1>tiny</h1>" in html and "model unloaded" in html, html
    assert "(no model)" not in html and "cannot batch" not in html


def test_a_budget_that_can_never_hold_the_default_model_makes_ready_503(daemon, tiny_models):
    assert httpx.get(f"{daemon.url}/ready").status_code == 200
    daemon.write_config(_config(tiny_models, "1MiB"))
    try:
        answer = daemon.reload().json()
        assert answer["outcome"] == "applied", answer
        (warning,) = answer["warnings"]
        assert "can never hold the default model tiny" in warning
        ready = httpx.get(f"{daemon.url}/ready")
        assert ready.status_code == 503
        assert "can never hold the default model tiny" in ready.json()["reason"]
        assert "1.0 MiB" in ready.json()["reason"]
        assert daemon.stats()["fleet"]["over_budget"] == warning
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = httpx.post(f"{daemon.url}/v1/chat/completions", json=body, timeout=60)
        assert refused.json()["error"]["code"] == "model_too_large"
    finally:
        daemon.write_config(_config(tiny_models, "auto"))
        assert daemon.reload().json()["warnings"] == []
    assert httpx.get(f"{daemon.url}/ready").status_code == 200


def test_a_reload_that_renames_the_model_says_the_old_id_is_gone(daemon, tiny_models):
    """Issue 33 item 2: the reload's answer names what clients lose."""
    renamed = toml_config(models={"small": {"path": str(tiny_models("llama")), "pin": True}})
    daemon.write_config(renamed)
    try:
        answer = daemon.reload().json()
        assert answer["outcome"] == "applied", answer
        (note,) = answer["notes"]
        assert "model tiny is no longer configured" in note and "404" in note
        assert f"reload (POST /admin/reload): {note}" in daemon.log()
    finally:
        daemon.write_config(_config(tiny_models, "auto"))
        back = daemon.reload().json()
    assert any("model small is no longer configured" in n for n in back["notes"])
