"""Downloads as the daemon runs them (mlxd/api/ops/downloads.py) and as the panel shows them.

In process, against the fake hub, with a stand-in fleet: ``[server] downloads =
true`` pulls a missing repo at start (and when a reload turns it on) and tells
the fleet when it is done; a request for a repo not pulled starts its job and
answers with its progress; the models panel's formatter shows a job's progress and the buttons.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlxd.api.ops.downloads import DownloadService
from mlxd.config import Settings
from mlxd.engine import Failed, FleetStatus
from mlxd.hub import HubPlace
from tests.support.fakehub import running_hub


class FleetStandIn:
    def __init__(self):
        self.done: list[str] = []

    def status(self) -> FleetStatus:
        return FleetStatus(budget_bytes=4 << 30, used_bytes=0, models=(), events=())

    def downloaded(self, model_id: str) -> None:
        self.done.append(model_id)


def _service(tmp_path: Path, place: HubPlace, *, downloads: bool):
    settings = Settings.model_validate(
        {
            "server": {"downloads": downloads, "state_dir": str(tmp_path / "state")},
            "models": {"tiny": {"repo": "org/tiny", "pin": True}, "later": {"repo": "org/later"}},
        }
    )
    fleet = FleetStandIn()
    state = SimpleNamespace(settings=settings, fleet=fleet)
    return DownloadService(state, place), fleet  # type: ignore[arg-type]


@pytest.fixture
def hub(tiny_models):
    with running_hub() as hub:
        hub.add_dir("org/tiny", tiny_models("llama"))
        hub.add_dir("org/later", tiny_models("llama_b"))
        yield hub


def test_downloads_on_pulls_at_start_and_for_a_request(hub, tmp_path: Path):
    place = HubPlace(hub.url, tmp_path / "hf-cache")
    service, fleet = _service(tmp_path, place, downloads=True)
    refused = Failed("model_load_failed", "not downloaded: run `mlxd pull org/later`", 503)

    async def run() -> Failed:
        service.autostart()  # both repos are missing: a job each
        started = {j["repo"] for j in service.jobs.jobs()}
        assert started == {"org/tiny", "org/later"}
        for _ in range(500):
            if len(fleet.done) == 2:
                break
            await asyncio.sleep(0.02)
        # A request for a repo that is there again is refused as it was (no new job).
        return service.on_load_failed("later", refused)

    assert asyncio.run(run()) is refused
    assert {j["state"] for j in service.jobs.jobs()} == {"done"}
    assert sorted(fleet.done) == ["later", "tiny"]  # told on the event loop, when done
    assert service.pulled("org/tiny", "main") and service.pulled("org/later", "main")


def test_a_request_starts_the_download_only_when_downloads_are_on(hub, tmp_path: Path):
    place = HubPlace(hub.url, tmp_path / "hf-cache")
    refused = Failed("model_load_failed", "not downloaded: run `mlxd pull org/later`", 503)
    off, _ = _service(tmp_path / "off", place, downloads=False)

    async def ask(service: DownloadService) -> Failed:
        service.autostart()
        return service.on_load_failed("later", refused)

    assert asyncio.run(ask(off)) is refused and off.jobs.jobs() == []
    hub.throttle = 300_000
    try:
        on, _ = _service(tmp_path / "on", place, downloads=True)
        answer = asyncio.run(ask(on))
    finally:
        hub.throttle = None
    assert answer.status == 503 and answer.retry_after == 10
    assert "The model 'later' is being downloaded from the hub (org/later)" in answer.message
    on.jobs.stop()


def test_downloads_turned_on_by_a_reload_pull_as_at_start(hub, tmp_path: Path):
    """``[server] downloads`` is live: a reload that turns it on pulls what is missing; one
    that keeps it on pulls only the models it adds (nothing runs twice)."""
    place = HubPlace(hub.url, tmp_path / "hf-cache")
    service, fleet = _service(tmp_path, place, downloads=False)
    state = service._state  # the stand-in AppState: a reload replaces its settings
    off = state.settings
    on = off.model_copy(update={"server": off.server.model_copy(update={"downloads": True})})

    async def run() -> None:
        service.autostart()  # off at start: nothing
        assert service.jobs.jobs() == []
        state.settings = on
        service.reloaded(off)  # the reload turned it on: both missing repos
        assert {j["repo"] for j in service.jobs.jobs()} == {"org/tiny", "org/later"}
        for _ in range(500):
            if len(fleet.done) == 2:
                break
            await asyncio.sleep(0.02)
        service.reloaded(on)  # left on, no model added: no new job
        assert len(service.jobs.jobs()) == 2

    asyncio.run(run())
    assert sorted(fleet.done) == ["later", "tiny"]
    service.jobs.stop()


def test_the_panel_shows_a_running_download_and_its_buttons():
    from mlxd.dashboard.models_panel import models_panel

    job = {
        "id": "j1",
        "state": "running",
        "phase": "downloading",
        "bytes_done": 3 << 20,
        "bytes_total": 12 << 20,
        "speed": 1 << 20,
        "eta": 9.0,
        "fit": "fits, with room for 4,096 tokens of context",
        "fits": True,
        "error": None,
        "resumable": False,
        "finished_at": None,
    }
    model = {
        "id": "m",
        "kind": "chat",
        "state": "failed",
        "pinned": False,
        "default": True,
        "weights_bytes": 0,
        "reserved_bytes": 0,
        "kv_bytes": 0,
        "prompt_cache_bytes": 0,
        "active": 0,
        "waiting": 0,
        "repo": "org/m",
        "revision": "main",
        "pulled": False,
        "download": job,
    }
    fleet = {"budget_bytes": 1 << 30, "used_bytes": 0, "models": [model], "events": []}
    (m,) = models_panel({"fleet": fleet, "actions": "tok"}, 100.0)["models"]
    assert m["download"]["pct"] == 25 and m["download"]["running"]
    assert m["download"]["detail"] == "3.0 MiB of 12.0 MiB (25%), 1.0 MiB/s, 9.0 s left"
    assert m["download_actions"] == {"download": False, "force": False, "cancel": True}
    assert not m["actions"]["load"] and not m["actions"]["pin"]  # not in the cache yet

    refused = {**job, "state": "failed", "fits": False, "error": "org/m: does not fit: …"}
    (m,) = models_panel({"fleet": {**fleet, "models": [{**model, "download": refused}]}}, 100.0)[
        "models"
    ]
    assert m["download_actions"] == {"download": True, "force": True, "cancel": False}
    done = {**job, "state": "done", "finished_at": 10.0}
    pulled = {**model, "pulled": True, "download": done}
    (m,) = models_panel({"fleet": {**fleet, "models": [pulled]}}, 100.0)["models"]
    assert m["download"] is None  # done more than a minute ago
    assert m["download_actions"] == {"download": False, "force": False, "cancel": False}
