"""POST /v1/rerank and /rerank (issue 37): the shipped all-MiniLM embedding model serves
rerank by cosine similarity; Jina/Cohere-shaped requests through httpx; limits as 400s."""

from __future__ import annotations

import time

import pytest

from mlxd.api.openai.rerank import MAX_DOCUMENTS
from tests.support.daemon import Daemon, toml_config

pytest.importorskip("mlx_embeddings")

QUERY = "capital of France"
DOCUMENTS = [
    "The recipe needs two cups of flour and an egg.",
    "Paris is the capital of France",
    "Stock markets fell sharply on Monday.",
    {"text": "My cat sleeps on the windowsill all afternoon."},
]


@pytest.fixture(scope="module")
def daemon(apps, tiny_models) -> Daemon:
    config = toml_config(
        models={"chat": {"path": str(tiny_models("llama"))}, "minilm": {"kind": "embedding"}}
    )
    return apps.get(config)


@pytest.fixture(scope="module")
def http(daemon):
    with daemon.client() as client:
        yield client


def rerank(http, path: str = "/v1/rerank", **fields):
    return http.post(path, json={"model": "minilm", "query": QUERY, **fields})


def test_minilm_ranks_paris_first_by_cosine(http, daemon) -> None:
    response = rerank(http, documents=DOCUMENTS, return_documents=True)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "minilm" and body["scoring"] == "embedding_cosine"
    results = body["results"]
    assert results[0]["index"] == 1
    assert results[0]["document"] == {"text": "Paris is the capital of France"}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and len(scores) == len(DOCUMENTS)
    assert scores[0] > 0.5 > scores[1], scores  # a real model, not noise
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(DOCUMENTS) + 1
    line = f"POST /v1/rerank 200 model=minilm inputs={len(DOCUMENTS)} prompt="
    assert line in wait_for_log(daemon, line)


def wait_for_log(daemon, text: str) -> str:
    deadline = time.monotonic() + 10
    while text not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    return daemon.log()


def test_root_path_top_n_and_no_documents_by_default(http) -> None:
    response = rerank(http, "/rerank", documents=DOCUMENTS, top_n=2)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert all(set(r) == {"index", "relevance_score"} for r in results)


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
    ],
)
def test_limits_are_clear_400s(http, fields, param, needle) -> None:
    response = http.post("/v1/rerank", json={"model": "minilm", "query": QUERY, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_a_chat_model_is_refused_naming_the_route(http) -> None:
    response = http.post("/v1/rerank", json={"model": "chat", "query": QUERY, "documents": ["a"]})
    assert response.status_code == 400, response.text
    assert "chat model" in response.json()["error"]["message"]
