"""The models panel with a reranker and a tiny Whisper in the fleet (issue 37), in a browser.

Each shows its kind, its state (unloaded until its first request loads it,
then loaded), its memory as weights only (no KV or prompt cache) and its
counts: requests served and the pairs or uploads they carried.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.support.audio import wav16
from tests.support.browser import frozen
from tests.support.daemon import toml_config
from tests.support.tinyrerank import build_cross_encoder

pytest.importorskip("mlx_audio")


def _wav(seconds: float = 0.5, rate: int = 16_000) -> bytes:
    return wav16(np.zeros(int(seconds * rate), np.int16), rate)


@pytest.fixture(scope="module")
def daemon(apps, tiny_models, tiny_embedding_model, tiny_whisper_model, tmp_path_factory):
    ce = build_cross_encoder(tiny_embedding_model, tmp_path_factory.mktemp("panel") / "ce")
    models = {
        "chat": {"path": str(tiny_models("llama"))},
        "ce": {"kind": "rerank", "path": str(ce)},
        "whisper": {"kind": "transcription", "path": str(tiny_whisper_model)},
    }
    return apps.get(toml_config(models=models))


def _row(page, model: str):
    return page.locator(f'#models tr[data-model="{model}"]')


@pytest.mark.browser
def test_rerank_and_transcription_models_in_the_panel(daemon, pages) -> None:
    page = pages(viewport={"width": 1280, "height": 900})
    page.goto(f"{daemon.url}/dashboard")
    with frozen(page):
        for model, kind in (("ce", "rerank"), ("whisper", "transcription")):
            row = _row(page, model)
            assert row.locator(f".badge.kind-{kind}").inner_text() == kind
            assert row.get_attribute("data-state") == "unloaded"
    rerank = httpx.post(
        f"{daemon.url}/v1/rerank",
        json={"model": "ce", "query": "river", "documents": ["a boat", "the sky", "a bank"]},
    )
    assert rerank.status_code == 200, rerank.text
    heard = httpx.post(
        f"{daemon.url}/v1/audio/transcriptions",
        files={"file": ("a.wav", _wav())},
        data={"model": "whisper"},
        timeout=60,
    )
    assert heard.status_code == 200, heard.text
    page.reload()  # a fresh render, not a wait for the next 2 s poll
    with frozen(page):
        for model, counts in (("ce", "1 served · 3 pairs"), ("whisper", "1 served · 1 upload")):
            row = _row(page, model)
            assert row.get_attribute("data-state") == "loaded"
            assert row.locator('[data-field="served"]').inner_text() == counts
            memory = row.locator('td[data-label="memory"]').inner_text()
            assert "no KV or prompt cache" in memory and "KV ·" not in memory
            assert row.locator('[data-field="queue"]').inner_text() == "0"
