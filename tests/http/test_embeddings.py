"""POST /v1/embeddings against the real daemon: a tiny chat model and the tiny BERT in
one registry, the real ``openai`` client (float and base64), httpx for bad input."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import pytest

from tests.support.daemon import Daemon, toml_config
from tests.support.tinyembed import chat_and_embedding_registry

KEY = "sk-embed-test"
TEXTS = ["hello river world", "The boats rock gently at their ropes.", "Why is the sky blue?"]
DIMS = 64  # tinyembed.EMBED_CONFIG["hidden_size"]


@pytest.fixture(scope="module")
def daemon(apps, tiny_models, tiny_embedding_model):
    config = toml_config(
        models=chat_and_embedding_registry(tiny_models, tiny_embedding_model),
        server={"api_keys": [KEY]},
        limits={"max_body_bytes": 8 * 1024 * 1024},
    )
    return apps.get(config)


@pytest.fixture(scope="module")
def http(daemon):
    with daemon.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def client(daemon):
    return daemon.openai(api_key=KEY)


@pytest.fixture(scope="module")
def tokenizer(tiny_embedding_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_embedding_model))


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def assert_error(response: httpx.Response, status: int, code: str | None, param=None) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_float_vectors_with_usage(client, tokenizer, daemon):
    response = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert response.object == "list" and response.model == "emb"
    assert [d.index for d in response.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == DIMS for d in response.data)
    np.testing.assert_allclose(np.linalg.norm(vectors(response), axis=1), 1.0, atol=1e-5)
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    # The request log line counts inputs and tokens apart (issue 22).
    # (This daemon takes an API key: its name leads the fields.)
    fields = f"model=emb inputs={len(TEXTS)} prompt={tokens} duration="
    line = f"POST /v1/embeddings 200 key=api_keys[0] {fields}"
    deadline = time.monotonic() + 10
    while line not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line in daemon.log()


def test_base64_decodes_to_the_float_vectors(client, http):
    floats = vectors(client.embeddings.create(model="emb", input=TEXTS, encoding_format="float"))
    # The openai client asks for base64 by default and decodes it itself.
    decoded = vectors(client.embeddings.create(model="emb", input=TEXTS))
    np.testing.assert_array_equal(decoded, floats)
    raw = http.post(
        "/v1/embeddings", json={"model": "emb", "input": TEXTS, "encoding_format": "base64"}
    )
    assert raw.status_code == 200, raw.text
    for row, item in zip(floats, raw.json()["data"], strict=True):
        blob = base64.b64decode(item["embedding"])
        assert len(blob) == DIMS * 4
        # Little-endian float32, exactly the float answer's values.
        np.testing.assert_array_equal(np.frombuffer(blob, dtype="<f4"), row)


def test_a_batch_equals_singles_and_identical_texts_have_cosine_one(client):
    together = vectors(client.embeddings.create(model="emb", input=[*TEXTS, TEXTS[0]]))
    assert float(together[0] @ together[3]) == pytest.approx(1.0, abs=1e-6)
    assert float(together[0] @ together[1]) < 0.99
    for i, text in enumerate(TEXTS):
        alone = vectors(client.embeddings.create(model="emb", input=text))[0]
        assert float(together[i] @ alone) > 0.9999


def test_token_ids_and_lists_of_token_ids(client, tokenizer):
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    from_text = vectors(client.embeddings.create(model="emb", input=TEXTS))
    from_ids = client.embeddings.create(model="emb", input=ids)
    assert from_ids.usage.prompt_tokens == sum(map(len, ids))
    np.testing.assert_allclose(vectors(from_ids), from_text, atol=1e-5)
    one = vectors(client.embeddings.create(model="emb", input=ids[1]))
    np.testing.assert_allclose(one[0], from_text[1], atol=1e-5)


def test_dimensions_truncate_and_renormalize(client):
    full = vectors(client.embeddings.create(model="emb", input=TEXTS))
    short = vectors(client.embeddings.create(model="emb", input=TEXTS, dimensions=16))
    assert short.shape == (3, 16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)


def test_an_alias_routes_and_the_response_names_the_id(client):
    response = client.embeddings.create(model="text-embedding-3-small", input="hi", user="u-1")
    assert response.model == "emb" and len(response.data[0].embedding) == DIMS
    # An empty name is the default model of the route's kind (here the only embedding model).
    assert client.embeddings.create(model="", input="hi").model == "emb"


def test_concurrent_requests_all_succeed_and_are_counted(daemon, http):
    def served() -> dict:
        models = http.get("/stats").json()["fleet"]["models"]
        return next(m for m in models if m["id"] == "emb")["engine"]

    client = daemon.async_openai(api_key=KEY)
    texts = [f"the river number {i} runs past the mill" for i in range(16)]
    before = served()

    async def run():
        return await asyncio.gather(
            *(client.embeddings.create(model="emb", input=t) for t in texts)
        )

    results = asyncio.run(run())
    assert all(len(r.data) == 1 and len(r.data[0].embedding) == DIMS for r in results)
    after = served()
    assert after["state"] == "ready" and after["batch_limit"] == 4
    assert after["requests_served"] - before["requests_served"] == 16
    assert after["inputs_embedded"] - before["inputs_embedded"] == 16
    assert 1 <= after["last_batch_size"] <= 4
    assert after["weights_bytes"] > 0


def test_v1_models_lists_the_embedding_model(http, client):
    client.embeddings.create(model="emb", input="load me")
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["emb"]["kind"] == "embedding" and models["emb"]["state"] == "loaded"
    assert models["emb"]["dimensions"] == DIMS
    assert models["emb"]["vocab_size"] > 0 and models["emb"]["supports_dimensions"] is not None
    assert models["chat"]["kind"] == "chat"


BAD = [
    ({"input": ""}, 400, "invalid_value", "input"),
    ({"input": []}, 400, "invalid_value", "input"),
    ({"input": ["ok", ""]}, 400, "invalid_value", "input"),
    ({"input": [[]]}, 400, "invalid_value", "input"),
    ({"input": ["ok", [1, 2]]}, 400, "invalid_type", "input"),
    ({"input": [[[2, 3]]]}, 400, "invalid_type", "input"),
    ({"input": [True, False]}, 400, "invalid_type", "input"),
    ({"input": [2, 1.5]}, 400, "invalid_type", "input"),
    ({"input": 42}, 400, "invalid_type", "input"),
    ({"input": [2, 400, 3]}, 400, "invalid_value", "input"),
    ({"input": [2, -1, 3]}, 400, "invalid_value", "input"),
    ({"input": [2, 2**70]}, 400, "invalid_value", "input"),
    ({"input": [[2, 3], [2, 2**63]]}, 400, "invalid_value", "input"),
    ({"input": [[2, 3], [2] * 129]}, 400, "context_length_exceeded", "input"),
    ({"input": ["ok", "word " * 300]}, 400, "context_length_exceeded", "input"),
    ({"input": "x " * 1_500_000}, 400, "context_length_exceeded", "input"),
    ({"input": ["x"] * 2049}, 400, "invalid_value", "input"),
    ({"input": "x", "dimensions": 0}, 400, "invalid_value", "dimensions"),
    ({"input": "x", "dimensions": DIMS + 1}, 400, "invalid_value", "dimensions"),
    ({"input": "x", "dimensions": "8"}, 400, "invalid_type", "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, 400, "invalid_value", "encoding_format"),
    ({"input": "x", "encoding_format": None}, 400, "invalid_type", "encoding_format"),
    ({"input": "x", "temperature": 1}, 400, "unknown_parameter", "temperature"),
    ({}, 400, "missing_required_parameter", "input"),
]


@pytest.mark.parametrize(("extra", "status", "code", "param"), BAD)
def test_bad_input_gets_its_error_and_the_daemon_keeps_serving(http, extra, status, code, param):
    assert_error(http.post("/v1/embeddings", json={"model": "emb", **extra}), status, code, param)
    ok = http.post("/v1/embeddings", json={"model": "emb", "input": "still here"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == DIMS


def test_the_error_names_the_input_that_is_too_long(http, tokenizer):
    # Fewer words than the context, more tokens: refused after tokenizing, with the count.
    text = "word " * 100
    tokens = len(tokenizer(text)["input_ids"])
    assert tokens > 128
    err = assert_error(
        http.post("/v1/embeddings", json={"model": "emb", "input": ["ok", "ok", text]}),
        400,
        "context_length_exceeded",
    )
    assert f"Input 2 is {tokens} tokens" in err["message"] and "128 tokens" in err["message"]


def test_missing_model_and_unknown_model(http):
    # No model: the default embedding model (issue 22), as for chat.
    r = http.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 200 and r.json()["model"] == "emb", r.text
    err = assert_error(
        http.post("/v1/embeddings", json={"model": "nope", "input": "x"}), 404, "model_not_found"
    )
    assert "'emb'" in err["message"]


def test_a_chat_model_on_embeddings_and_the_embedding_model_on_chat_get_400(http):
    response = http.post("/v1/embeddings", json={"model": "chat", "input": "x"})
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    # Sentences that start with a capital, each route said once (issue 22).
    assert err["message"] == (
        "'chat' is a chat model: send it to /v1/chat/completions, /v1/completions, "
        "/v1/responses or /v1/messages. This route serves the embedding models: emb."
    )
    response = http.post(
        "/v1/chat/completions",
        json={"model": "emb", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["message"] == (
        "'emb' is an embedding model: send it to /v1/embeddings. "
        "This route serves the chat models: chat."
    )
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.status_code == 200, chat.text


def test_the_api_key_is_required(daemon):
    response = httpx.post(f"{daemon.url}/v1/embeddings", json={"model": "emb", "input": "x"})
    assert_error(response, 401, "invalid_api_key")
    wrong = httpx.post(
        f"{daemon.url}/v1/embeddings",
        json={"model": "emb", "input": "x"},
        headers={"Authorization": "Bearer nope"},
    )
    assert_error(wrong, 401, "invalid_api_key")


def test_without_the_extra_the_model_fails_to_load_and_chat_keeps_serving(
    tmp_path, tiny_models, tiny_embedding_model
):
    # An install without mlx-embeddings, for real: a package of that name that cannot be
    # imported shadows the installed one in the daemon's process.
    blocker = tmp_path / "blocked" / "mlx_embeddings"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError(\"No module named 'mlx_embeddings'\")\n"
    )
    config = toml_config(models=chat_and_embedding_registry(tiny_models, tiny_embedding_model))
    d = Daemon(tmp_path / "d", config, env={"PYTHONPATH": str(blocker.parent)}).start()
    try:
        with d.client() as http:
            err = assert_error(
                http.post("/v1/embeddings", json={"model": "emb", "input": "x"}),
                503,
                "model_load_failed",
            )
            assert "pip install 'mlxd[embeddings]'" in err["message"]
            chat = http.post(
                "/v1/chat/completions",
                json={
                    "model": "chat",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
            )
            assert chat.status_code == 200, chat.text
            models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
            assert models["emb"]["state"] == "failed"
            assert "mlxd[embeddings]" in models["emb"]["error"]
        assert d.proc is not None and d.proc.poll() is None
    finally:
        d.stop()


def test_an_embedding_model_shares_the_memory_budget_with_chat(
    tmp_path, tiny_models, tiny_embedding_model
):
    # Room for either model (weights: chat 0.86 MB, emb 0.42 MB; plus a row of the chat's
    # KV), not both: each load evicts the other, idle one, and requests still succeed.
    models = chat_and_embedding_registry(tiny_models, tiny_embedding_model)
    models["chat"]["prompt_cache"] = {"max_bytes": 0, "max_entries": 0}
    config = toml_config(models=models, memory={"budget": 1_200_000})
    d = Daemon(tmp_path / "d", config).start()

    def fleet(http) -> tuple[dict, dict]:
        body = http.get("/stats").json()["fleet"]
        return body, {m["id"]: m for m in body["models"]}

    chat_body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with d.client() as http:
            for _ in range(2):
                assert http.post("/v1/chat/completions", json=chat_body).status_code == 200
                body, models = fleet(http)
                assert models["chat"]["state"] == "loaded" and models["emb"]["state"] != "loaded"
                assert body["used_bytes"] <= body["budget_bytes"]
                r = http.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"]})
                assert r.status_code == 200, r.text
                body, models = fleet(http)
                assert models["emb"]["state"] == "loaded" and models["chat"]["state"] != "loaded"
                assert models["emb"]["weights_bytes"] == models["emb"]["engine"]["weights_bytes"]
                assert models["emb"]["reserved_bytes"] == models["emb"]["weights_bytes"] > 0
                assert body["used_bytes"] <= body["budget_bytes"]
            events = http.get("/stats").json()["fleet"]["events"]
            evicted = [e["model"] for e in events if e["kind"] == "evicted"]
            assert "chat" in evicted and "emb" in evicted, events
        assert d.stop() == 0, d.log()[-3000:]
    finally:
        d.stop()


def test_a_reload_adds_changes_and_removes_the_embedding_model(
    tmp_path, tiny_models, tiny_embedding_model
):
    """One daemon: a reload adds the embedding model, changes its batch size while it is
    loaded, and removes it; with ``unknown_parameters = "ignore"`` all along."""
    both = chat_and_embedding_registry(tiny_models, tiny_embedding_model)
    chat_only = {"chat": both["chat"]}
    server = {"unknown_parameters": "ignore"}
    d = Daemon(tmp_path / "d", toml_config(models=chat_only, server=server)).start()
    try:
        with d.client() as http:
            assert_error(
                http.post("/v1/embeddings", json={"model": "emb", "input": "x"}),
                404,
                "model_not_found",
            )
            d.write_config(toml_config(models=both, server=server))
            assert d.reload().status_code == 200
            ok = http.post("/v1/embeddings", json={"model": "emb", "input": ["x", "y"]})
            assert ok.status_code == 200, ok.text
            assert len(ok.json()["data"]) == 2

            # Unknown parameters are dropped when the config says ignore.
            body = {"model": "emb", "input": "x", "input_type": "query", "truncate": "END"}
            response = http.post("/v1/embeddings", json=body)
            assert response.status_code == 200, response.text
            assert response.headers["X-Mlxd-Ignored-Parameters"] == "input_type, truncate"
            assert len(response.json()["data"][0]["embedding"]) == DIMS
            # Known parameters are still checked.
            bad = http.post("/v1/embeddings", json={**body, "encoding_format": "hex"})
            assert_error(bad, 400, "invalid_value", "encoding_format")

            # A reload changes the batch size of the loaded embedding model.
            def limit() -> int:
                fleet = http.get("/stats").json()["fleet"]["models"]
                return next(m for m in fleet if m["id"] == "emb")["engine"]["batch_limit"]

            assert limit() == 4
            resized = {**both, "emb": {**both["emb"], "batch": {"size": 2}}}
            d.write_config(toml_config(models=resized, server=server))
            assert d.reload().status_code == 200
            assert limit() == 2

            d.write_config(toml_config(models=chat_only, server=server))
            assert d.reload().status_code == 200
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
                if "emb" not in ids:
                    break
                time.sleep(0.2)
            assert "emb" not in ids
            assert_error(
                http.post("/v1/embeddings", json={"model": "emb", "input": "x"}),
                404,
                "model_not_found",
            )
            chat = http.post(
                "/v1/chat/completions",
                json={
                    "model": "chat",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
            )
            assert chat.status_code == 200, chat.text
        # The embedding thread's MLX state is released before exit: a clean 0, no abort.
        assert d.stop() == 0, d.log()[-3000:]
    finally:
        d.stop()


def test_metrics_count_embeddings_per_model(http, client):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, tuple], float]:
        text = http.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            if f.name.startswith("mlxd_embedding")
            for s in f.samples
        }

    client.embeddings.create(model="emb", input="warm up")
    before = scrape()
    response = client.embeddings.create(model="emb", input=TEXTS)
    http.post("/v1/embeddings", json={"model": "emb", "input": [[2, 999]]})  # refused: 400
    after = scrape()
    emb = (("model", "emb"),)

    def grew(name: str, labels=emb) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert grew("mlxd_embedding_inputs_total") == 3
    assert grew("mlxd_embedding_tokens_total") == response.usage.prompt_tokens
    assert grew("mlxd_embedding_requests_total", (("model", "emb"), ("outcome", "served"))) == 1
    # The refusal came from the HTTP side's checks: it never reached the engine's counts.
    assert grew("mlxd_embedding_requests_total", (("model", "emb"), ("outcome", "failed"))) == 0
    assert grew("mlxd_embedding_forward_passes_total") >= 1
    assert 1 <= after[("mlxd_embedding_last_batch_size", emb)] <= 4
    assert after[("mlxd_embedding_queued_requests", emb)] == 0
