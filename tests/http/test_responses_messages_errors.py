"""Auth, limits and refusals on ``/v1/responses`` and ``/v1/messages``: each route's
error envelope and status, the SDKs' typed exceptions, and a daemon that serves the
next request."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest

from tests.support.daemon import Daemon, toml_config

KEY = "sekrit-key"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        server={"api_keys": [KEY]},
        model={"path": str(tiny_models("llama")), "name": "tiny"},
        batch={"size": 1},
        limits={"max_queued": 1, "max_body_bytes": 4096, "max_tokens": 256},
    )
    return apps.get(config, env={"MLXD_FAULT_INJECTION": "1"})


def claude(d: Daemon, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key=key, max_retries=0)


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


def test_messages_auth_takes_x_api_key_or_bearer(daemon):
    body = {"model": "tiny", "max_tokens": 2, "messages": MSG}
    with daemon.client() as http:
        anthropic_error(http.post("/v1/messages", json=body), 401, "authentication_error")
        r = http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        anthropic_error(r, 401, "authentication_error")
        assert http.post("/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200
        bearer = {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
        assert http.post("/v1/messages", json=body, headers=bearer).status_code == 200
        r = http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": MSG})
        anthropic_error(r, 401, "authentication_error")
        # /v1/responses answers in the OpenAI shape, and takes either header too.
        r = http.post("/v1/responses", json={"model": "tiny", "input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = http.post(
            "/v1/responses",
            json={"model": "tiny", "input": "hi", "max_output_tokens": 2},
            headers={"x-api-key": KEY},
        )
        assert r.status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        claude(daemon, "wrong").messages.create(model="tiny", max_tokens=2, messages=MSG)
    with pytest.raises(openai.AuthenticationError):
        daemon.openai(api_key="wrong", max_retries=0).responses.create(model="tiny", input="hi")


def test_oversized_bodies_get_413_in_each_shape(daemon):
    big = "x" * 5000
    auth = {"x-api-key": KEY}
    with daemon.client() as http:
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": big}]}
        msg = anthropic_error(
            http.post("/v1/messages", json=body, headers=auth), 413, "request_too_large"
        )
        assert "max_body_bytes" in msg
        r = http.post("/v1/responses", json={"model": "tiny", "input": big}, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(anthropic.APIStatusError) as err:
        claude(daemon).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": big}]
        )
    assert err.value.status_code == 413


def test_unknown_routes_and_methods_under_messages(daemon):
    with daemon.client(headers={"x-api-key": KEY}) as http:
        anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
        r = http.get("/v1/messages/count_tokens")
        anthropic_error(r, 405, "invalid_request_error")
        r = http.post("/v1/messages/nope/deeper", json={})
        anthropic_error(r, 404, "not_found_error")
        r = http.put("/v1/responses/resp_x", json={})
        assert r.status_code == 405 and "error" in r.json() and "type" not in r.json()


def test_unknown_previous_response_id_is_a_clear_400(daemon):
    client = daemon.openai(api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_gone")
    assert err.value.code == "previous_response_not_found"
    assert "resp_gone" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_gone")


def test_full_queue_is_429_with_retry_after_on_both_routes(daemon):
    auth = {"x-api-key": KEY}

    async def burst(path: str, body: dict) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120, headers=auth) as client:
            return await asyncio.gather(*(client.post(path, json=body) for _ in range(5)))

    messages = asyncio.run(
        burst("/v1/messages", {"model": "tiny", "max_tokens": 200, "messages": MSG})
    )
    refused = [r for r in messages if r.status_code == 429]
    assert refused and any(r.status_code == 200 for r in messages)
    for r in refused:
        anthropic_error(r, 429, "rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1
    responses = asyncio.run(
        burst("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 200})
    )
    refused = [r for r in responses if r.status_code == 429]
    assert refused and any(r.status_code == 200 for r in responses)
    for r in refused:
        assert r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
    # The anthropic SDK raises its typed exception (its own retries are off here).
    client = claude(daemon)

    async def sdk_burst() -> list[object]:
        aclient = anthropic.AsyncAnthropic(base_url=daemon.url, api_key=KEY, max_retries=0)

        async def one():
            try:
                return await aclient.messages.create(model="tiny", max_tokens=200, messages=MSG)
            except anthropic.RateLimitError as exc:
                return exc

        return await asyncio.gather(*(one() for _ in range(5)))

    results = asyncio.run(sdk_burst())
    assert any(isinstance(r, anthropic.RateLimitError) for r in results)
    assert client.messages.create(model="tiny", max_tokens=2, messages=MSG).usage.output_tokens


def test_unsupported_fields_are_refused_by_name(daemon):
    auth = {"x-api-key": KEY}
    with daemon.client(headers=auth) as http:
        for field, value in [
            ("background", True),
            ("conversation", "conv_1"),
            ("truncation", "auto"),
            ("top_logprobs", 3),
            ("prompt", {"id": "pmpt_1"}),
        ]:
            r = http.post("/v1/responses", json={"model": "tiny", "input": "hi", field: value})
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field
        for field, value in [("container", "c1"), ("mcp_servers", [{"url": "x"}])]:
            body = {"model": "tiny", "max_tokens": 2, "messages": MSG, field: value}
            msg = anthropic_error(
                http.post("/v1/messages", json=body), 400, "invalid_request_error"
            )
            assert field in msg
        r = http.post(
            "/v1/messages",
            json={"model": "tiny", "max_tokens": 2, "messages": MSG, "metadata": {"user_id": "u"}},
        )
        assert r.status_code == 200


def test_a_failing_generation_is_an_error_in_each_api(daemon):
    """A row that fails mid-generation: response.failed, Anthropic's error event, or a 500."""
    fault = {"mlxd_fault": "logits_processor@3"}
    client = daemon.openai(api_key=KEY, max_retries=0)
    events = list(
        client.responses.create(
            model="tiny", input="hi", max_output_tokens=50, stream=True, extra_body=fault
        )
    )
    assert events[0].type == "response.created"
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert events[-1].response.error.code == "generation_error"
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="tiny", input="hi", max_output_tokens=50, extra_body=fault)

    sdk = claude(daemon)
    with (
        pytest.raises(anthropic.APIStatusError) as err,
        sdk.messages.stream(model="tiny", max_tokens=50, messages=MSG, extra_body=fault) as stream,
    ):
        for _ in stream:
            pass
    assert err.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.InternalServerError) as err:
        sdk.messages.create(model="tiny", max_tokens=50, messages=MSG, extra_body=fault)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "api_error"
    # The next request is served.
    assert sdk.messages.create(model="tiny", max_tokens=3, messages=MSG).usage.output_tokens
