"""A ``[memory] budget`` that runs short of the loaded models (issue 22), tiny models only.

Before: a reload lowering the budget below the loaded models answered
``applied``, every chat request then got ``400 context_over_budget`` with a
KV budget of 0 bytes, ``/ready`` stayed ready and no idle model was unloaded
(with ``keep_alive = "forever"`` never). Now a lowered budget unloads idle
unpinned models to fit, a request short of KV room because of other models'
weights unloads an idle one and runs, and what cannot be unloaded (pinned
models) is a warning in the reload's answer, ``/ready``'s 503 reason and
``fleet.over_budget``.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx
import pytest

from mlxd.config import format_bytes
from mlxd.control import reload_lines, status_lines
from tests.support import ROOT
from tests.support.browser import frozen
from tests.support.daemon import Daemon, toml_config

MiB = 1024**2
KiB = 1024
CACHE = "8MiB"  # each model's prompt-cache cap: its reservation is mostly this


def weights(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


@pytest.fixture(scope="module")
def paths(tiny_models) -> dict[str, Path]:
    return {"a": Path(tiny_models("llama")), "b": Path(tiny_models("llama_b"))}


@pytest.fixture(scope="module")
def unpinned(daemons, paths) -> Daemon:
    """Both models unpinned, 256 MiB: the two eviction tests in file order (the second
    puts the budget back to 256 MiB first)."""
    return daemons.get(config(paths, 256 * MiB), name="overcommit-unpinned")


@pytest.fixture(scope="module")
def pinned(daemons, paths) -> Daemon:
    """Both models pinned, 256 MiB: shared by the pinned tests, each of which lowers the
    budget and then puts it back (and puts it back first, should an earlier one have failed)."""
    return daemons.get(config(paths, 256 * MiB, pin=True), name="overcommit-pinned")


def config(paths: dict[str, Path], budget: int, *, pin: bool = False) -> str:
    return toml_config(
        memory={"budget": budget},
        batch={"kv_budget": "auto"},
        models={
            m: {
                "path": str(p),
                "pin": pin,
                "keep_alive": "forever",
                "prompt_cache": {"max_bytes": CACHE},
            }
            for m, p in paths.items()
        },
    )


def chat(d: Daemon, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=120)


def busy(model: dict) -> bool:
    """Whether a model of ``/stats`` ``fleet.models`` has requests or engine work."""
    engine = model.get("engine") or {}
    return bool(model["active"] or engine.get("rows") or engine.get("pending"))


def states(d: Daemon) -> dict[str, str]:
    return {m["id"]: m["state"] for m in d.stats()["fleet"]["models"]}


def reload(d: Daemon, text: str) -> dict:
    d.write_config(text)
    return d.reload().json()


def wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_a_lowered_budget_unloads_idle_models_and_chat_keeps_working(unpinned, paths):
    need = {m: weights(p) + 8 * MiB for m, p in paths.items()}
    d = unpinned
    assert chat(d, "a").status_code == 200
    assert chat(d, "b").status_code == 200  # both loaded; b used last
    assert states(d) == {"a": "loaded", "b": "loaded"}
    # Both idle as the engines see it (a loaded machine publishes a finished
    # request's end a moment after its answer): only idle models are evicted.
    wait_for(lambda: not any(busy(m) for m in d.stats()["fleet"]["models"]))

    # Room for one model and its KV, not for both.
    answer = reload(d, config(paths, max(need.values()) + 2 * MiB))
    assert answer["outcome"] == "applied", answer
    assert httpx.get(f"{d.url}/ready").status_code == 200
    for model in ("b", "a", "b"):  # each load unloads the other: never a KV budget of 0
        reply = chat(d, model)
        assert reply.status_code == 200, reply.text
    assert answer["evicted"] == ["a"] and answer["warnings"] == []
    # Human units where a person reads (the JSON keeps the bytes): the server's
    # log line with old -> new values, the events' values, the CLI's lines.
    budget = f"memory.budget 256 MiB → {format_bytes(max(need.values()) + 2 * MiB)}"
    assert f"reload (POST /admin/reload): applied; applied {budget}" in d.log()
    (values,) = d.stats()["reloads"][0]["values"]
    assert values[1:] == ["256 MiB", format_bytes(max(need.values()) + 2 * MiB)]
    lines, _ = reload_lines(200, answer)
    assert f"  memory.budget: 256 MiB -> {values[2]} (live)" in lines
    assert "unloaded to fit [memory] budget: a" in lines
    events = [(e["model"], e["kind"], e["detail"]) for e in d.stats()["fleet"]["events"]]
    evicted = [e for e in events if e[1] == "evicted"]
    assert evicted[0][0] == "a" and "[memory] budget after a reload" in evicted[0][2]
    assert [m for m, _, _ in evicted] == ["a", "b", "a"]
    assert d.stats()["fleet"]["over_budget"] is None


def test_a_request_short_of_kv_room_unloads_another_idle_model(unpinned, paths):
    """Both models fit with a few KiB to spare: a's request needs more KV than b's
    weights leave, so b (idle, unpinned) is unloaded and the request runs."""
    need = {m: weights(p) + 8 * MiB for m, p in paths.items()}
    d = unpinned
    assert reload(d, config(paths, 256 * MiB))["outcome"] == "applied"  # room for both
    assert chat(d, "b").status_code == 200
    assert chat(d, "a").status_code == 200
    answer = reload(d, config(paths, sum(need.values()) + 4 * KiB))
    assert states(d) == {"a": "loaded", "b": "loaded"}
    reply = chat(d, "a")
    assert reply.status_code == 200, reply.text
    assert answer["outcome"] == "applied" and answer["evicted"] == []
    assert states(d) == {"a": "loaded", "b": "unloaded"}
    evicted = [e for e in d.stats()["fleet"]["events"] if e["kind"] == "evicted"]
    assert evicted[-1]["model"] == "b" and "KV room" in evicted[-1]["detail"]


def test_pinned_models_over_a_lowered_budget_warn_and_make_the_daemon_unready(pinned, paths):
    need = {m: weights(p) + 8 * MiB for m, p in paths.items()}
    d = pinned
    reload(d, config(paths, 256 * MiB, pin=True))
    assert chat(d, "a").status_code == 200
    answer = reload(d, config(paths, sum(need.values()) - 64 * KiB, pin=True))
    ready = httpx.get(f"{d.url}/ready")
    assert ready.status_code == 503 and "over-committed" in ready.json()["reason"]
    assert answer["outcome"] == "applied" and answer["evicted"] == []
    (warning,) = answer["warnings"]
    assert "[memory] budget" in warning and "over-committed" in warning
    assert re.search(r"\ba [\d.]+ MiB \(pinned\)", warning), warning
    assert "over-committed" in d.stats()["fleet"]["over_budget"]
    lines, code = status_lines(d.url, d.stats())  # what `mlxd status` prints
    assert code == 1 and any(line.startswith("  cannot serve: [memory]") for line in lines)

    refused = chat(d, "a")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_over_budget"
    assert "[memory] budget" in error["message"] and "over-committed" in error["message"]
    assert "kv_budget" not in error["message"] and "0 B" not in error["message"]

    assert reload(d, config(paths, 256 * MiB, pin=True))["warnings"] == []
    assert httpx.get(f"{d.url}/ready").status_code == 200
    assert chat(d, "a").status_code == 200


@pytest.mark.browser
def test_the_dashboard_says_loudly_that_the_daemon_cannot_serve(pinned, paths, pages):
    need = {m: weights(p) + 8 * MiB for m, p in paths.items()}
    d = pinned
    reload(d, config(paths, 256 * MiB, pin=True))
    reload(d, config(paths, sum(need.values()) - 64 * KiB, pin=True))
    for width, height in ((1280, 800), (390, 844)):
        page = pages(viewport={"width": width, "height": height})
        page.goto(f"{d.url}/dashboard")
        with frozen(page):  # the status bar polls: read one version of it
            banner = page.locator('#status-bar [data-field="over-budget"]')
            assert banner.is_visible()
            text = banner.inner_text()
            assert text.startswith("Cannot serve requests:") and "over-committed" in text
            assert "(pinned)" in text and "raise [memory] budget" in text
            assert page.locator("#status-bar .badge.bad", has_text="cannot serve").is_visible()
            box = banner.bounding_box()
            assert box is not None and box["y"] < height  # above the fold, not under the panels
        if os.environ.get("MLXD_SCREENSHOT") == "1":
            shot = ROOT / "docs" / "img" / f"dashboard-over-budget-{width}.png"
            page.screenshot(path=str(shot))
    reload(d, config(paths, 256 * MiB, pin=True))
    page = pages(viewport={"width": 1280, "height": 800})
    page.goto(f"{d.url}/dashboard")
    assert page.locator('[data-field="over-budget"]').count() == 0
