"""The dashboard with several models at work (issue 22), in a real browser at 1280 and 390 px.

Two tiny chat models (``a``, the default, and ``b``) stream at once beside a
tiny embedding model. Before, Throughput, Running, Waiting and the KV gauge
showed only the default model without saying so, the memory panel's MLX bar
sat under "KV … of … budget", an embedding row read "0 B KV · 0 B of 0 B
cache", a busy model read "last used 18 s ago", the legend said "cap", and on a
phone the throughput headline came after the whole models panel.
``MLXD_SCREENSHOT=1`` writes docs/img/dashboard-several-models-{1280,390}.png.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.support import ROOT
from tests.support.browser import frozen
from tests.support.daemon import Daemon, toml_config

WAIT_MS = 30_000


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models, tiny_embedding_model) -> Daemon:
    config = toml_config(
        batch={"size": 4},
        sampling={"temperature": 0.0},
        models={
            "a": {"path": str(tiny_models("llama")), "default": True, "pin": True},
            "b": {"path": str(tiny_models("llama_b")), "pin": True},
            "emb": {"path": str(tiny_embedding_model), "kind": "embedding"},
        },
    )
    return daemons.get(config, name="dashboard-fleet")


def _streams(d: Daemon, stop: threading.Event) -> list[threading.Thread]:
    def run(model: str) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "story"}],
            "max_tokens": 3000,
            "stream": True,
        }
        with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=run, args=(m,), daemon=True) for m in ("a", "a", "b", "b")]
    for t in threads:
        t.start()
    return threads


def _running(d: Daemon) -> dict[str, int]:
    models = d.stats()["fleet"]["models"]
    return {m["id"]: (m.get("engine") or {}).get("rows", 0) for m in models}


@pytest.mark.browser
def test_every_model_at_work_is_shown_and_labelled(daemon: Daemon, pages) -> None:
    emb = httpx.post(f"{daemon.url}/v1/embeddings", json={"model": "emb", "input": "x"})
    assert emb.status_code == 200, emb.text
    stop = threading.Event()
    threads = _streams(daemon, stop)
    try:
        deadline = time.monotonic() + 60
        while not (_running(daemon)["a"] >= 1 and _running(daemon)["b"] >= 1):
            assert time.monotonic() < deadline, _running(daemon)
            time.sleep(0.1)
        for width, height in ((1280, 900), (390, 844)):
            page = pages(viewport={"width": width, "height": height})
            page.goto(f"{daemon.url}/dashboard")
            with frozen(page):  # the regions poll: read one version of each
                throughput = page.locator("#throughput")
                # Every chat model, each labelled, with the totals of all of them.
                per_model = throughput.locator('[data-field="per-model"]')
                for model in ("a", "b"):
                    row = per_model.locator(f'tr[data-model="{model}"]')
                    assert int(row.locator('[data-field="running"]').inner_text()) >= 1
                every = throughput.locator('[data-field="all-models"]').inner_text()
                assert "every model:" in every
                assert "model a (default)" in throughput.locator("h2").inner_text()
                assert page.locator('#kv-gauge [data-field="kv-scope"]').inner_text() == (
                    "model a (default)"
                )
                # The MLX bar sits in the MLX active entry, not under the KV line.
                active = page.locator("#memory dl div", has_text="MLX active")
                assert active.locator('[data-field="mlx-active-bar"]').count() == 1
                models = page.locator("#models")
                assert "in use now" in models.locator('tr[data-model="a"]').inner_text()
                emb = models.locator('tr[data-model="emb"] td[data-label="memory"]')
                embedding = emb.inner_text()
                assert "no KV or prompt cache" in embedding and "0 B of 0 B" not in embedding
                assert "prompt-cache reserve" in models.locator(".legend").inner_text()
                # The headline comes before the models panel (on a phone: above the fold).
                head, panel = throughput.bounding_box(), models.bounding_box()
                assert head is not None and panel is not None and head["y"] < panel["y"]
                if width == 390:
                    assert head["y"] < height
            if os.environ.get("MLXD_SCREENSHOT") == "1":
                shot = ROOT / "docs" / "img" / f"dashboard-several-models-{width}.png"
                page.screenshot(path=str(shot), full_page=width == 1280)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
