"""The Batch API against a real daemon: the ``openai`` SDK's files and batches, end to end.

A tiny chat model and the tiny BERT in one registry (keys on). Each output
line must equal what the direct call answers (greedy), bad lines land in the
error file with the direct call's error, bad files are refused at upload,
and one key never sees another's files or batches.
"""

from __future__ import annotations

import io
import json
import re
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from tests.support.daemon import toml_config
from tests.support.stats_schema import check_schema, documented_fields
from tests.support.tinyembed import chat_and_embedding_registry
from tests.support.tinyrerank import build_cross_encoder

KEY = "sk-batch-test"
OTHER = "sk-batch-other"

# What differs between two answers to the same request: ids, clocks, prompt-cache hits.
VOLATILE = {"id", "created", "created_at", "system_fingerprint", "cached_tokens"}


@pytest.fixture(scope="module")
def daemon(apps, tiny_models, tiny_embedding_model, tmp_path_factory):
    cross_encoder = build_cross_encoder(
        tiny_embedding_model, tmp_path_factory.mktemp("batch-rerank") / "ce"
    )
    config = toml_config(
        models={
            **chat_and_embedding_registry(tiny_models, tiny_embedding_model),
            "ce": {"kind": "rerank", "path": str(cross_encoder)},
        },
        server={"api_keys": [KEY, OTHER]},
        batch={"size": 4},
        batches={"max_file_bytes": "64KiB", "max_lines": 40, "upload_timeout": 2.0},
    )
    return apps.get(config)


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return daemon.openai(api_key=KEY)


@pytest.fixture(scope="module")
def http(daemon):
    with daemon.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, text: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def stable(value: Any) -> Any:
    """``value`` without the fields that differ between two identical requests."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not finish: {batch}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_chat_batch_end_to_end_equals_direct_calls(client, http):
    good = [chat_line(f"q{i}", f"Tell me about the number {i}.") for i in range(5)]
    bad = [
        chat_line("negative", "hi", max_tokens=-1),  # the route's 400
        chat_line("unknown-model", "hi", model="no-such-model"),  # the fleet's 404
        chat_line("bad-param", "hi", frobnicate=True),  # unknown parameter: 400
    ]
    lines = [good[0], bad[0], *good[1:3], bad[1], *good[3:], bad[2]]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert client.files.content(uploaded.id).content == jsonl(lines)

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert any(b.id == batch.id for b in client.batches.list(limit=5).data)
    done = wait_final(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (8, 5)
    assert done.request_counts.failed == 3
    assert done.in_progress_at and done.finalizing_at and done.completed_at

    output = lines_of(client, done.output_file_id)
    errors = lines_of(client, done.error_file_id)
    assert [o["custom_id"] for o in output] == [g["custom_id"] for g in good]
    assert [e["custom_id"] for e in errors] == ["negative", "unknown-model", "bad-param"]
    for line, out in zip(good, output, strict=True):
        direct = http.post(line["url"], json=line["body"])
        assert out["response"]["status_code"] == direct.status_code == 200
        assert stable(out["response"]["body"]) == stable(direct.json())
        assert out["response"]["request_id"] == direct_id(out)
    for line, err in zip(bad, errors, strict=True):
        direct = http.post(line["url"], json=line["body"])
        assert err["response"]["status_code"] == direct.status_code >= 400
        assert err["response"]["body"] == direct.json()
    # /metrics counts the lines (the module's other batches may have run before this one).
    metrics = http.get("/metrics").text
    completed = re.search(r'^mlxd_batch_lines_total\{outcome="completed"\} (\S+)$', metrics, re.M)
    failed = re.search(r'^mlxd_batch_lines_total\{outcome="failed"\} (\S+)$', metrics, re.M)
    assert completed and float(completed[1]) >= 5 and failed and float(failed[1]) >= 3
    assert re.search(r"^mlxd_batch_queued_lines ", metrics, re.M)


def direct_id(out: dict[str, Any]) -> str:
    return out["response"]["body"]["id"]


def test_embedding_batch_equals_direct_call(client, http):
    bodies = [{"model": "emb", "input": text} for text in ("a river", "the sky", "a boat")]
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": b}
        for i, b in enumerate(bodies)
    ]
    uploaded = client.files.create(file=("emb.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = wait_final(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    output = lines_of(client, done.output_file_id)
    for body, out in zip(bodies, output, strict=True):
        assert out["response"]["body"] == http.post("/v1/embeddings", json=body).json()


def test_rerank_batch_equals_direct_calls_and_audio_is_not_batched(client, http):
    docs = ["a boat on the river", "why is the sky blue", "the river bank"]
    bodies = [
        {"model": "ce", "query": "the river", "documents": docs, "top_n": 2},
        {"model": "emb", "query": "the sky", "documents": docs, "return_documents": True},
    ]
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/rerank", "body": b}
        for i, b in enumerate(bodies)
    ]
    uploaded = client.files.create(file=("r.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/rerank",
        completion_window="24h",
    )
    done = wait_final(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    output = lines_of(client, done.output_file_id)
    for body, out in zip(bodies, output, strict=True):
        assert out["response"]["status_code"] == 200
        assert stable(out["response"]["body"]) == stable(http.post("/v1/rerank", json=body).json())
    assert len(output[0]["response"]["body"]["results"]) == 2
    # A transcription is a multipart upload: no batch line can carry one.
    audio_line = {**lines[0], "url": "/v1/audio/transcriptions"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("a.jsonl", io.BytesIO(jsonl([audio_line]))), purpose="batch")
    message = caught.value.body["message"]  # type: ignore[index]
    assert "Line 1 " in message and "multipart" in message
    refused = http.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.id,
            "endpoint": "/v1/audio/transcriptions",
            "completion_window": "24h",
        },
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "endpoint"
    assert "multipart" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "line", "says"),
    [
        (b"this is not json\n", 1, "not valid JSON"),
        (b'{"custom_id": "a"}\n[1, 2]\n', 1, "'method'"),
        (jsonl([chat_line("a", "x"), chat_line("a", "y")]), 2, "used twice"),
        (jsonl([chat_line("a", "x", stream=True)]), 1, "stream"),
        (jsonl([{**chat_line("a", "x"), "url": "/v1/models"}]), 1, "'url'"),
        (jsonl([{**chat_line("a", "x"), "body": "text"}]), 1, "'body'"),
        (jsonl([chat_line(f"c{i}", "x") for i in range(41)]), 41, "batches.max_lines"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", 1, "not valid JSON"),
    ],
)
def test_bad_files_are_refused_naming_the_line(client, content, line, says):
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
    message = caught.value.body["message"]  # type: ignore[index]
    assert f"Line {line} " in message and says in message


def test_upload_limits_and_form(daemon, client):
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", io.BytesIO(b" " * 70_000)), purpose="batch")
    assert caught.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.files.create(
            file=("x.jsonl", io.BytesIO(jsonl([chat_line("a", "x")]))), purpose="fine-tune"
        )  # type: ignore[arg-type]
    # A web page's cross-site form post is refused before it is read.
    answer = httpx.post(
        f"{daemon.url}/v1/files",
        headers={"Authorization": f"Bearer {KEY}", "Origin": "http://evil.example"},
        files={"file": ("a.jsonl", jsonl([chat_line("a", "x")]))},
        data={"purpose": "batch"},
    )
    assert answer.status_code == 403


def test_one_key_never_sees_another_keys_files_or_batches(daemon, client):
    uploaded = client.files.create(
        file=("mine.jsonl", io.BytesIO(jsonl([chat_line("a", "x")]))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = daemon.openai(api_key=OTHER)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert all(f.id != uploaded.id for f in other.files.list().data)
    assert all(b.id != batch.id for b in other.batches.list().data)
    wait_final(client, batch.id)


def test_cancel_stops_a_running_batch(daemon, client):
    lines = [chat_line(f"long{i}", "Count to a thousand.", max_tokens=200) for i in range(30)]
    uploaded = client.files.create(file=("l.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # /stats shows the open batch as docs/api.md's `batches` table says.
    fields = {k: v for k, v in documented_fields().items() if k.split(".")[0] == "batches"}
    seen: set[str] = set()
    stats = daemon.stats()
    check_schema({"batches": stats["batches"]}, fields, seen)
    assert seen == set(fields), sorted(set(fields) - seen)
    assert any(b["id"] == batch.id for b in stats["batches"]["batches"])
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_final(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts is not None and done.request_counts.completed < 30
    assert len(lines_of(client, done.output_file_id)) == done.request_counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again: a no-op


def test_batch_refusals(client, http):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    uploaded = client.files.create(
        file=("m.jsonl", io.BytesIO(jsonl([chat_line("a", "x")]))), purpose="batch"
    )
    for body, param in (
        ({"endpoint": "/v1/models", "completion_window": "24h"}, "endpoint"),
        ({"endpoint": "/v1/chat/completions", "completion_window": "soon"}, "completion_window"),
        (
            {
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {f"k{i}": "v" for i in range(17)},
            },
            "metadata",
        ),
    ):
        answer = http.post("/v1/batches", json={"input_file_id": uploaded.id, **body})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    # A file whose lines ask for another endpoint fails validation, naming the line.
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    failed = wait_final(client, batch.id)
    assert failed.status == "failed" and failed.errors is not None
    assert failed.errors.data and failed.errors.data[0].line == 1
    assert failed.errors.data[0].code == "mismatched_endpoint"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)  # a failed batch has nothing left to cancel
    # Deleting: a finished batch's files may go; the list no longer has them.
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/v1/completions", {"model": "chat", "prompt": "Once upon a", "max_tokens": 8}),
        ("/v1/responses", {"model": "chat", "input": "Say hi.", "max_output_tokens": 8}),
    ],
)
def test_completions_and_responses_batches_equal_direct_calls(client, http, url, body):
    body = {**body, "temperature": 0}
    lines = [{"custom_id": "only", "method": "POST", "url": url, "body": body}]
    uploaded = client.files.create(file=("r.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="1h")
    done = wait_final(client, batch.id)
    assert done.status == "completed", done
    [out] = lines_of(client, done.output_file_id)
    direct = http.post(url, json=body)
    assert out["response"]["status_code"] == direct.status_code == 200
    assert stable(out["response"]["body"]) == stable(direct.json())
    if url == "/v1/responses":  # a batch line is never stored; the direct call is
        assert http.get(f"/v1/responses/{out['response']['body']['id']}").status_code == 404
        assert http.get(f"/v1/responses/{direct.json()['id']}").status_code == 200


def test_a_stalled_upload_gets_408(daemon):
    """An upload that stops arriving is cut off after upload_timeout, not held open."""
    boundary = "xyz"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    request = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(head) + 5000}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(request + head)
        chunks = [sock.recv(65536)]
        waited = time.monotonic() - started
        while chunks[-1]:  # the server closes the connection after its answer
            chunks.append(sock.recv(65536))
        answer = b"".join(chunks).decode()
    assert answer.startswith("HTTP/1.1 408") and "batches.upload_timeout" in answer
    assert 1.5 <= waited < 20


def test_lists_paginate_as_openai(client):
    made = []
    for i in range(3):
        data = io.BytesIO(jsonl([chat_line(f"p{i}", "x", max_tokens=1)]))
        uploaded = client.files.create(file=(f"p{i}.jsonl", data), purpose="batch")
        made.append(
            client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
            ).id
        )
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    # The SDK's auto-pagination walks every page, newest first, each batch once.
    walked = [b.id for b in client.batches.list(limit=2)]
    assert walked[:3] == made[::-1] and len(walked) == len(set(walked))
    files = client.files.list(purpose="batch")
    assert [f.filename for f in files.data][:3] == ["p2.jsonl", "p1.jsonl", "p0.jsonl"]
    for batch_id in made:
        done = wait_final(client, batch_id)
        assert done.output_file_id is not None
        assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    outputs = [f.id for f in client.files.list(purpose="batch_output").data]
    assert outputs and all(o.startswith("file-") for o in outputs)
