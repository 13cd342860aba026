"""Bad input against the real daemon: the documented status, the OpenAI error
shape, and a server that still answers the next request."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.support.daemon import toml_config
from tests.support.inprocess import AppInProcess


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        model={"path": str(tiny_models("llama")), "max_context": 64},
        batch={"size": 2},
        limits={"max_body_bytes": 2048, "max_tokens": 64},
        sampling={"temperature": 0.0},
    )
    return apps.get(config)


@pytest.fixture(scope="module")
def http(daemon):
    with daemon.client() as client:
        yield client


@pytest.fixture(scope="module")
def model(daemon):
    return daemon.model_id()


def chat(model, **kw):
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        **kw,
    }


def assert_error(
    response: httpx.Response, status: int, *, code: str | None = None, param: str | None = None
):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serving(http, model):
    r = http.post("/v1/chat/completions", json=chat(model))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_good_request_works(http, model):
    assert_still_serving(http, model)


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (b"\xff\xfe{}", 400, "invalid_json", None),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "caf\\udc80"}]}',
            400,
            None,
            None,
        ),
    ],
)
def test_malformed_bodies(http, model, body, status, code, param):
    r = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_error(r, status, code=code, param=param)
    assert_still_serving(http, model)


@pytest.mark.parametrize(
    ("change", "code", "param"),
    [
        ({"max_tokens": "ten"}, "invalid_type", "max_tokens"),
        ({"messages": "hello"}, "invalid_type", "messages"),
        ({"temperature": [1]}, "invalid_type", "temperature"),
        ({"messages": []}, "invalid_value", "messages"),
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"max_tokens": -3}, "invalid_value", "max_tokens"),
        ({"max_completion_tokens": 0}, "invalid_value", "max_tokens"),
        ({"max_tokens": 2.5}, "invalid_type", "max_tokens"),
        ({"temperature": 5}, "invalid_value", "temperature"),
        ({"top_p": 0}, "invalid_value", "top_p"),
        ({"top_logprobs": 3}, "invalid_value", "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "invalid_value", "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "invalid_value", "logit_bias"),
        ({"logit_bias": {"5": 500}}, "invalid_value", "logit_bias"),
        ({"n": 2}, "unsupported_parameter", "n"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tools_unsupported",
            "tool_choice",
        ),
        ({"response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
        ({"frobnicate": True}, "unknown_parameter", "frobnicate"),
        ({"mlxd_fault": "logits_processor"}, "unknown_parameter", "mlxd_fault"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "invalid_value", "messages[0].content"),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "invalid_value",
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "invalid_image",
            "messages[0].content[0].image_url",
        ),
    ],
)
def test_invalid_parameters_get_400_with_the_param(http, model, change, code, param):
    r = http.post("/v1/chat/completions", json=chat(model, **change))
    assert_error(r, 400, code=code, param=param)


def test_missing_required_field(http, model):
    r = http.post("/v1/chat/completions", json={"model": model})
    assert_error(r, 400, code="missing_required_parameter", param="messages")
    # Issue 22: no model is the default model, as configuration.md says.
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == model, r.text
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.json()["model"] == model, r.text


def test_unknown_model_is_404(http, model):
    r = http.post("/v1/chat/completions", json=chat("gpt-4o"))
    err = assert_error(r, 404, code="model_not_found", param="model")
    assert model in err["message"]
    assert_error(http.get("/v1/models/gpt-4o"), 404, code="model_not_found")


def test_body_over_the_limit_is_413(http, model):
    big = chat(model, messages=[{"role": "user", "content": "x" * 4000}])
    err = assert_error(http.post("/v1/chat/completions", json=big), 413, code="request_too_large")
    # Sizes a person reads (issue 22), and the key as the config writes it.
    assert re.search(r"is \d+\.\d KiB; this server accepts at most \d", err["message"]), err
    assert "[limits] max_body_bytes" in err["message"] and " bytes" not in err["message"]
    assert_still_serving(http, model)


def test_body_over_the_limit_without_content_length_is_413(http, model):
    def chunks():
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    r = http.post(
        "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(r, 413, code="request_too_large")
    assert_still_serving(http, model)


def test_prompt_over_the_context_is_400_context_length_exceeded(http, model):
    long = chat(model, messages=[{"role": "user", "content": "word " * 200}])
    err = assert_error(
        http.post("/v1/chat/completions", json=long), 400, code="context_length_exceeded"
    )
    assert "64" in err["message"]
    assert_still_serving(http, model)


def test_completions_errors(http, model):
    base = {"model": model, "prompt": "hi", "max_tokens": 3}
    assert http.post("/v1/completions", json=base).status_code == 200
    assert_error(http.post("/v1/completions", json={**base, "prompt": ""}), 400, param="prompt")
    assert_error(
        http.post("/v1/completions", json={**base, "prompt": ["a", "b"]}), 400, param="prompt"
    )
    assert_error(http.post("/v1/completions", json={**base, "echo": True}), 400, param="echo")
    assert_error(http.post("/v1/completions", json={**base, "logprobs": 9}), 400, param="logprobs")
    assert_error(
        http.post("/v1/completions", json={**base, "prompt": [1, 2, 999999]}), 400, param="prompt"
    )


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing-here"), 404, code="unknown_route")
    assert_error(http.get("/v1/chat/completions"), 405, code="method_not_allowed")


def test_health_and_ready(http):
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


@pytest.fixture(scope="module")
def keyed(apps, tiny_models):
    config = toml_config(
        model={"path": str(tiny_models("llama"))}, server={"api_keys": ["sk-one", "sk-two"]}
    )
    return apps.get(config)


def test_api_keys_guard_v1(keyed):
    with keyed.client() as http:
        model = "llama"
        assert_error(http.get("/v1/models"), 401, code="invalid_api_key")
        assert_error(http.get("/v1/models", headers={"authorization": "Bearer sk-wrong"}), 401)
        assert_error(http.get("/v1/models", headers={"authorization": "sk-one"}), 401)
        ok = http.get("/v1/models", headers={"authorization": "Bearer sk-two"})
        assert ok.status_code == 200 and ok.json()["data"]
        assert http.get("/health").status_code == 200  # liveness stays open for supervisors
        del model
    client = keyed.openai(api_key="sk-one")
    assert client.models.list().data[0].id


def test_no_422_anywhere(http, model):
    """Litestar's own validation (422) never answers an OpenAI route."""
    bodies = [
        b"",
        b"null",
        b'{"model": 1}',
        b'{"model": "x", "messages": {}}',
        b'{"model": "x", "prompt": null}',
    ]
    for path in ("/v1/chat/completions", "/v1/completions"):
        for body in bodies:
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code in (400, 404), (path, body, r.status_code, r.text)
            assert_error(r, r.status_code)


def test_full_queue_answers_429_with_retry_after(tmp_path, tiny_models):
    config = toml_config(
        model={"path": str(tiny_models("llama"))}, batch={"size": 1}, limits={"max_queued": 1}
    )
    d = AppInProcess(tmp_path, config).start()
    try:
        model = d.model_id()

        async def main():
            async with httpx.AsyncClient(base_url=d.url, timeout=120) as client:
                body = chat(model, max_tokens=200)
                return await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=body) for _ in range(5))
                )

        responses = asyncio.run(main())
        refused = [r for r in responses if r.status_code == 429]
        assert refused and any(r.status_code == 200 for r in responses)
        for r in refused:
            assert_error(r, 429, code="queue_full")
            assert int(r.headers["retry-after"]) >= 1
        assert d.stats()["counters"]["rejected"]["queue_full"] == len(refused)
    finally:
        d.stop()


def test_max_tokens_above_the_limit_is_clamped_on_chat_and_responses(http, model):
    """Issue 33 item 12: 10000 > [limits] max_tokens (64) stops at 64, said in a header."""
    r = http.post("/v1/chat/completions", json=chat(model, max_tokens=10000, temperature=0))
    assert r.status_code == 200, r.text
    assert r.headers["x-mlxd-max-tokens"] == "64; requested=10000"
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] <= 64
    r = http.post(
        "/v1/responses",
        json={"model": model, "input": "hello", "max_output_tokens": 10000, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-mlxd-max-tokens"] == "64; requested=10000"
    assert r.json()["status"] == "incomplete"
    r = http.post("/v1/chat/completions", json=chat(model, max_tokens=-1))
    assert_error(r, 400, code="invalid_value", param="max_tokens")
    assert "x-mlxd-max-tokens" not in http.post("/v1/chat/completions", json=chat(model)).headers
