"""The models panel's Download, progress bar and Cancel, in Chromium, against the fake hub.

One daemon (``HF_ENDPOINT`` at :mod:`tests.support.fakehub`, its own
``HF_HUB_CACHE``) configures one repo model that is not in the cache: 6 MiB of
weights served at 1.5 MB/s, so the download is seen running. The panel shows
the Download button beside the fit check, the job's progress bar moving with
the panel's poll, and Cancel, which leaves the job resumable.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.daemon import Daemon, toml_config
from tests.support.fakehub import running_hub

WAIT_MS = 30_000
CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_hub() as hub:
        hub.add_dir_files(
            "org/big",
            {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": os.urandom(6 << 20)},
        )
        hub.throttle = 1_500_000
        work = tmp_path_factory.mktemp("downloads-panel")
        config = toml_config(
            memory={"budget": "64MiB"},
            prompt_cache={"max_bytes": "1MiB", "disk": False},
            models={"big": {"repo": "org/big"}},
        )
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(work / "hf-cache")}
        d = Daemon(work, config, env=env).start()
        try:
            yield d
        finally:
            d.stop()


@pytest.mark.browser
def test_download_progress_and_cancel_in_a_browser(daemon: Daemon, pages) -> None:
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
    detail = page.locator(
        '#models tr.model-download[data-model="big"] [data-field="download-detail"]'
    )
    assert "of 6.0 MiB" in detail.inner_text()
    assert (
        "fits, with room for 2,048 tokens" in page.locator("#models tr.model-download").inner_text()
    )

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
    jobs = daemon.client().get("/admin/downloads").json()["data"]
    assert jobs[0]["state"] == "cancelled" and 0 < jobs[0]["bytes_done"] < jobs[0]["bytes_total"]
    assert not problems, problems
