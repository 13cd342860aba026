"""Models from the hub end to end: ``mlxd pull`` and the daemon, through the local fake hub.

``HF_ENDPOINT`` points the real ``huggingface_hub`` at :mod:`tests.support.fakehub`
and ``HF_HUB_CACHE`` at a cache of this module's own, so the CLI and the daemon
use the variables as an operator would. One daemon: a pulled repo serves chat,
a pinned repo not pulled names ``mlxd pull`` (its requests and ``/ready``)
until ``POST /admin/models/{id}/pull`` brings it (a running job with bytes in
progress, then done), then it loads at once and serves; in Chromium, the
models panel's Download (beside the fit check), progress bar and Cancel.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxd.hub import HubPlace, pull
from tests.support.browser import frozen
from tests.support.daemon import Daemon
from tests.support.fakehub import FakeHub, running_hub
from tests.support.stats_schema import check_schema, documented_fields

CONFIG = """\
[memory]
budget = "{budget}"

[sampling]
temperature = 0.0

[prompt_cache]
max_bytes = "1MiB"
disk = false

[models.tiny]
repo = "org/tiny"
default = true
pin = true

[models.later]
repo = "org/later"
pin = {pin_later}
"""
# A repo that is only ever downloaded in the browser test: 6 MiB, served slowly there.
BIG = """
[models.big]
repo = "org/big"
"""
BIG_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def hub(tiny_models):
    with running_hub() as hub:
        hub.add_dir("org/tiny", tiny_models("llama"))
        hub.add_dir("org/later", tiny_models("llama_b"))
        hub.add_dir_files(
            "org/big",
            {
                "config.json": json.dumps(BIG_CONFIG).encode(),
                "model.safetensors": os.urandom(6 << 20),
            },
        )
        yield hub


@pytest.fixture(scope="module")
def env(hub: FakeHub, tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("hf-cache")
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1"}


def mlxd_pull(env: dict[str, str], *args: str, config: Path | None = None):
    cmd = [sys.executable, "-m", "mlxd", "pull", *args]
    if config is not None:
        cmd += ["--config", str(config)]
    return subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_an_interrupted_pull_exits_130_and_the_next_one_resumes(hub, env, tmp_path):
    weights = os.urandom(3 << 20)  # three 1 MiB chunks
    files = {"config.json": json.dumps(BIG_CONFIG).encode(), "model.safetensors": weights}
    hub.add_dir_files("org/chunky", files)
    config = tmp_path / "mlxd.toml"
    config.write_text(CONFIG.format(budget="2GiB", pin_later="false"))
    hub.throttle = 1_000_000
    cmd = [sys.executable, "-m", "mlxd", "pull", "org/chunky", "--config", str(config)]
    proc = subprocess.Popen(
        cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        blobs = Path(env["HF_HUB_CACHE"]) / "models--org--chunky" / "blobs"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            partial = [p for p in blobs.glob("*.incomplete") if p.stat().st_size >= 1 << 20]
            if partial:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        hub.throttle = None
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "org/chunky: interrupted; `mlxd pull org/chunky` resumes where it stopped" in err
    assert out == ""

    done = mlxd_pull(env, "org/chunky", config=config)
    assert done.returncode == 0, done.stderr
    last = hub.weight_gets()[-1]
    assert last.path.startswith("/org/chunky/") and last.range is not None
    resumed_at = int(last.range.removeprefix("bytes=").rstrip("-"))
    assert resumed_at >= 1 << 20 and last.sent == len(weights) - resumed_at
    assert (Path(done.stdout.strip()) / "model.safetensors").read_bytes() == weights


def wait_ready_reason(c: httpx.Client, text: str) -> httpx.Response:
    """``/ready`` once its answer holds ``text`` (the daemon binds, then loads)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            ready = c.get("/ready")
            if text in ready.text:
                return ready
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/ready never said {text!r}")


def test_pull_fits_downloads_and_a_second_pull_moves_nothing(hub, env, tmp_path):
    config = tmp_path / "mlxd.toml"
    config.write_text(CONFIG.format(budget="2GiB", pin_later="false"))
    done = mlxd_pull(env, "org/tiny", config=config)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])  # the snapshot directory, last
    assert path.is_relative_to(env["HF_HUB_CACHE"]) and (path / "model.safetensors").is_file()
    assert "org/tiny: " in done.stderr and "fits, with room for 4,096 tokens" in done.stderr
    assert "6/6 files" in done.stderr
    served = hub.bytes_served()

    again = mlxd_pull(env, "org/tiny", config=config)
    assert again.returncode == 0 and again.stdout.strip() == str(path)
    assert hub.bytes_served() == served


def test_pull_refuses_what_does_not_fit_and_what_does_not_exist(hub, env, tmp_path):
    config = tmp_path / "mlxd.toml"
    config.write_text(CONFIG.format(budget="512KiB", pin_later="false"))
    big = mlxd_pull(env, "org/later", config=config)
    assert big.returncode == 3
    assert "org/later: " in big.stderr and "does not fit: " in big.stderr
    assert "of weights against a 512 KiB budget" in big.stderr
    assert not [r for r in hub.weight_gets() if "org/later" in r.path]  # no weight byte moved

    missing = mlxd_pull(env, "org/missing")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip() == (
        f"org/missing: no such repo on {hub.url} (or it is private: set HF_TOKEN to a token "
        "with access)"
    )


@pytest.fixture(scope="module")
def daemon(hub, env, tmp_path_factory):
    # org/tiny pulled in process (the CLI's pull is tested above); org/big only named.
    pull("org/tiny", place=HubPlace(hub.url, Path(env["HF_HUB_CACHE"])))
    config = CONFIG.format(budget="2GiB", pin_later="true") + BIG
    d = Daemon(tmp_path_factory.mktemp("daemon"), config, env=env).start(wait_ready=False)
    try:
        yield d
    finally:
        d.stop()


def test_a_daemon_serves_a_pulled_repo_and_pulls_another_on_an_admins_word(hub, daemon):
    hub.throttle = 1_000_000  # org/later takes about a second: the job is seen running
    try:
        with daemon.client() as c:
            # Pinned and not pulled: the daemon runs, not ready, and says what to do.
            ready = wait_ready_reason(c, "mlxd pull")
            assert ready.status_code == 503
            assert "run `mlxd pull org/later`" in ready.json()["reason"]
            c.get("/v1/models").raise_for_status()
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            assert c.post("/v1/chat/completions", json={**chat, "model": "tiny"}).status_code == 200

            refused = c.post("/v1/chat/completions", json={**chat, "model": "later"})
            assert refused.status_code == 503
            assert "run `mlxd pull org/later`" in refused.json()["error"]["message"]
            models = {m["id"]: m for m in c.get("/stats").json()["fleet"]["models"]}
            assert models["tiny"]["pulled"] is True and models["later"]["pulled"] is False
            assert models["later"]["repo"] == "org/later"
            # Its own chat template (ChatML, no tools), not the demo model's hermes-tools.
            assert models["tiny"]["capabilities"]["tools"] is False

            started = c.post("/admin/models/later/pull")
            assert started.status_code == 202, started.text
            job = started.json()
            assert (job["repo"], job["revision"], job["state"]) == ("org/later", "main", "running")
            seen_running = False
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                job = c.get(f"/admin/downloads/{job['id']}").json()
                if job["state"] == "running" and 0 < job["bytes_done"] < job["bytes_total"]:
                    seen_running = True
                if job["state"] != "running":
                    break
                time.sleep(0.1)
            assert seen_running and job["state"] == "done", job
            assert job["fits"] is True and job["fit"].startswith("fits, with room for")
            # /stats shows the job on its model, as docs/api.md documents it.
            fields, seen = documented_fields(), set()
            check_schema(c.get("/stats").json(), fields, seen)
            assert {f for f in fields if f.startswith("downloads[].")} <= seen
            listed = c.get("/admin/downloads").json()["data"]
            assert listed[0]["id"] == job["id"] and listed[0]["bytes_done"] == job["bytes_total"]

            daemon.wait_ready(60)  # the pinned model loaded once its download was done
            models = c.get("/ready").json()["models"]
            assert (models["tiny"], models["later"]) == ("loaded", "loaded")
            served = c.post("/v1/chat/completions", json={**chat, "model": "later"})
            assert served.status_code == 200, served.text
    finally:
        hub.throttle = None


# ---------------------------------------------------------------- the dashboard, in Chromium


@pytest.mark.browser
def test_download_progress_and_cancel_in_a_browser(hub, daemon: Daemon, pages) -> None:
    hub.throttle = 1_500_000  # 6 MiB in about four seconds: progress and Cancel are seen
    try:
        _download_and_cancel(daemon, pages)
    finally:
        hub.throttle = None


def _download_and_cancel(daemon: Daemon, pages) -> None:
    page = pages(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{daemon.url}/dashboard")
    page.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")
    row = page.locator('#models tr[data-model="big"]').first
    assert "not downloaded" in row.locator('[data-field="repo"]').inner_text()
    assert "fit is checked" in row.locator('[data-field="fit"]').inner_text()

    row.locator('button[data-action="download"]').click()
    page.locator('#models-result[data-outcome="done"]').wait_for(timeout=WAIT_MS)
    assert page.locator("#models-result").inner_text() == "download of org/big started"
    # The progress bar moves with the panel's poll.
    page.wait_for_function(
        """() => { const p = document.querySelector(
             '#models tr.model-download[data-model="big"][data-download-state="running"] progress');
           return !!p && p.value > 0 && p.value < 100; }""",
        timeout=WAIT_MS,
    )
    job = page.locator('#models tr.model-download[data-model="big"]')
    with frozen(page):
        assert "of 6.0 MiB" in job.locator('[data-field="download-detail"]').inner_text()
        assert "fits, with room for 2,048 tokens" in job.inner_text()

    page.locator('#models button[data-action="cancel-download"]').click()
    page.locator(
        '#models tr.model-download[data-model="big"][data-download-state="cancelled"]'
    ).wait_for(timeout=WAIT_MS)
    done = page.locator('#models tr.model-download[data-model="big"]')
    assert "resumable" in done.inner_text()
    # Download is offered again: it resumes what the cancelled job fetched.
    page.locator('#models tr[data-model="big"] button[data-action="download"]').wait_for(
        timeout=WAIT_MS
    )
    jobs = [
        j for j in daemon.client().get("/admin/downloads").json()["data"] if j["model"] == "big"
    ]
    assert jobs[0]["state"] == "cancelled" and 0 < jobs[0]["bytes_done"] < jobs[0]["bytes_total"]
    assert not problems, problems
