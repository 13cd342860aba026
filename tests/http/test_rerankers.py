"""``kind = "rerank"`` (issue 37): a tiny cross-encoder and a tiny yes/no LM reranker serve
/v1/rerank in the fleet, beside an embedding model (cosine) and a chat model; each score is
checked against the same number computed here another way."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxd.api.openai.rerank import MAX_DOCUMENTS
from mlxd.engine.rerank.loading import load_tensors
from tests.support.daemon import Daemon, toml_config
from tests.support.tinyrerank import build_cross_encoder, build_yes_no_lm

pytest.importorskip("mlx_embeddings")

QUERY = "the river"
DOCS = ["a boat on the river", "why is the sky blue", "the river bank"]
JUDGE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant "
    "passages that answer the query\n<Query>: {q}\n<Document>: {d}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_models, tiny_embedding_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerankers")
    return {
        "ce": build_cross_encoder(tiny_embedding_model, root / "ce"),
        "lm": build_yes_no_lm(tiny_models("llama"), root / "lm"),
    }


@pytest.fixture(scope="module")
def daemon(apps, tiny_models, tiny_embedding_model, dirs) -> Daemon:
    models = {
        "chat": {"path": str(tiny_models("llama"))},
        "emb": {"kind": "embedding", "path": str(tiny_embedding_model)},
        "ce": {"kind": "rerank", "path": str(dirs["ce"])},
        "lm": {"kind": "rerank", "path": str(dirs["lm"]), "keep_alive": "1s"},
    }
    return apps.get(toml_config(models=models))


def rerank(daemon, model: str | None, **fields):
    body = {"query": QUERY, "documents": DOCS, **fields}
    if model is not None:
        body["model"] = model
    with daemon.client() as http:
        return http.post("/v1/rerank", json=body)


def scores_by_index(body) -> np.ndarray:
    out = np.zeros(len(DOCS), dtype=np.float32)
    for r in body["results"]:
        out[r["index"]] = r["relevance_score"]
    return out


def cross_encoder_reference(embedding_dir: Path, ce_dir: Path) -> np.ndarray:
    """sigmoid(classifier(pooler)) through mlx-embeddings' own loader, one pair at a time."""
    from mlx_embeddings.utils import load
    from transformers import AutoTokenizer

    model, _ = load(str(embedding_dir))
    head = load_tensors(ce_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(ce_dir))
    out = []
    for doc in DOCS:
        enc = tokenizer(QUERY, doc, return_token_type_ids=True)
        ids = mx.array([enc["input_ids"]])
        types = mx.array([enc["token_type_ids"]])
        pooled = model(ids, token_type_ids=types).pooler_output
        logit = pooled @ head["classifier.weight"].T + head["classifier.bias"]
        out.append(float(mx.sigmoid(logit)[0, 0]))
    return np.array(out, dtype=np.float32)


def yes_no_reference(lm_dir: Path) -> np.ndarray:
    from mlx_lm import load

    loaded = load(str(lm_dir))
    model, tokenizer = loaded[0], loaded[1]
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    out = []
    for doc in DOCS:
        ids = tokenizer.encode(JUDGE.format(q=QUERY, d=doc), add_special_tokens=False)
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        pair = mx.softmax(mx.stack([logits[no], logits[yes]]))
        out.append(float(pair[1]))
    return np.array(out, dtype=np.float32)


def test_a_cross_encoder_scores_pairs_as_its_classifier_does(daemon, dirs, tiny_embedding_model):
    response = rerank(daemon, "ce", return_documents=True)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["scoring"] == "cross_encoder" and body["model"] == "ce"
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in body["results"])
    expected = cross_encoder_reference(tiny_embedding_model, dirs["ce"])
    np.testing.assert_allclose(scores_by_index(body), expected, atol=1e-4)
    assert body["usage"]["total_tokens"] > 3 * 4


def test_a_yes_no_lm_reranker_scores_p_yes(daemon, dirs):
    response = rerank(daemon, "lm", top_n=2)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["scoring"] == "yes_no_lm" and len(body["results"]) == 2
    expected = yes_no_reference(dirs["lm"])
    best = np.argsort(-expected, kind="stable")[:2]
    assert [r["index"] for r in body["results"]] == [int(i) for i in best]
    got = [r["relevance_score"] for r in body["results"]]
    np.testing.assert_allclose(got, expected[best], atol=1e-3)


def test_no_model_means_the_default_reranker_and_an_embedding_model_scores_by_cosine(daemon):
    body = rerank(daemon, None).json()
    assert body["model"] == "ce" and body["scoring"] == "cross_encoder"
    body = rerank(daemon, "emb").json()
    assert body["model"] == "emb" and body["scoring"] == "embedding_cosine"
    assert all(-1.0 <= r["relevance_score"] <= 1.0 for r in body["results"])


def test_rerankers_are_in_the_fleet(daemon):
    rerank(daemon, "ce")
    with daemon.client() as http:
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        stats = {m["id"]: m for m in http.get("/stats").json()["fleet"]["models"]}
        metrics = http.get("/metrics").text
        embeddings = http.post("/v1/embeddings", json={"model": "ce", "input": "x"})
    assert listed["ce"]["kind"] == "rerank" and listed["ce"]["scoring"] == "cross_encoder"
    assert stats["ce"]["state"] == "loaded" and stats["ce"]["weights_bytes"] > 0
    assert stats["ce"]["engine"]["requests_served"] >= 1
    assert 'mlxd_embedding_requests_total{model="ce",outcome="served"}' in metrics
    assert embeddings.status_code == 400
    assert "'ce' is a rerank model: send it to /v1/rerank" in embeddings.json()["error"]["message"]


def test_a_pair_longer_than_the_context_is_a_400_naming_the_document(daemon):
    response = rerank(daemon, "ce", documents=["ok", "word " * 400])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "documents"
    assert error["message"].startswith("Document 1 (with the query) is "), error


def test_a_reranker_unloads_after_its_keep_alive(daemon):
    assert rerank(daemon, "lm").status_code == 200
    deadline = time.monotonic() + 15
    state, models = None, {}
    while time.monotonic() < deadline:
        with daemon.client() as http:
            models = {m["id"]: m for m in http.get("/stats").json()["fleet"]["models"]}
        state = models["lm"]["state"]
        if state == "unloaded":
            break
        time.sleep(0.2)
    assert state == "unloaded" and models["lm"]["weights_bytes"] == 0, models["lm"]


def test_the_root_path_top_n_and_no_documents_by_default(daemon) -> None:
    with daemon.client() as http:
        response = http.post(
            "/rerank", json={"model": "emb", "query": QUERY, "documents": DOCS, "top_n": 2}
        )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 2 and all(set(r) == {"index", "relevance_score"} for r in results)


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"documents": []}, "documents", "empty list"),
        ({"documents": ["ok", "  "]}, "documents", "Document 1 is empty"),
        ({"documents": ["x"] * (MAX_DOCUMENTS + 1)}, "documents", f"at most {MAX_DOCUMENTS}"),
        ({"documents": ["ok"], "query": ""}, "query", "'query' must not be empty"),
        ({"documents": ["ok"], "top_n": 0}, "top_n", "at least 1"),
        ({"documents": ["ok", "word " * 5000]}, "documents", "Document 1 is 5000 words"),
        ({"documents": ["ok"], "query": "word " * 5000}, "query", "The query is 5000 words"),
        ({"model": "chat", "documents": ["ok"]}, "model", "is a chat model"),
    ],
)
def test_limits_are_clear_400s(daemon, fields, param, needle) -> None:
    with daemon.client() as http:
        response = http.post("/v1/rerank", json={"model": "emb", "query": QUERY, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
