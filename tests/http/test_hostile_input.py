"""Hostile and careless input against the real daemon (issue: harden the boundary).

Each test sends what once crashed the daemon, stalled it, or let a web page
reconfigure it, and checks the documented answer and that the daemon serves
the next request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.support.daemon import toml_config

ALLOWED = "box.lan"


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        server={"allowed_hosts": [ALLOWED, "*.proxy.example"]},
        model={"path": str(tiny_models("llama"))},
        batch={"size": 4},
        limits={"max_queued": 8, "header_timeout": 1.0, "body_timeout": 1.0},
        sampling={"temperature": 0.0},
    )
    # Its own: a test rewrites its config and reads its log.
    return apps.get(config, name="hardening")


@pytest.fixture(scope="module")
def http(daemon):
    with daemon.client() as client:
        yield client


@pytest.fixture(scope="module")
def model(daemon):
    return daemon.model_id()


@pytest.fixture(scope="module")
def vocab(http):
    # The served vocabulary: every id below it is valid, none at or above it.
    return http.get("/stats").json()["model"]["vocab_size"]


def chat(model, **kw):
    messages = [{"role": "user", "content": "hello"}]
    return {"model": model, "messages": messages, "max_tokens": 3, **kw}


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_serving(http, model):
    r = http.post("/v1/chat/completions", json=chat(model))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- token ids


def test_vocab_is_reported(vocab):
    assert 500 <= vocab < 1000  # the tiny tokenizer: 512 pieces plus special tokens


@pytest.mark.parametrize("key", ["60000", "999999999", "99999999999999999999999", "{vocab}"])
def test_logit_bias_ids_outside_the_vocabulary(http, model, vocab, key):
    key = key.format(vocab=vocab)
    r = http.post("/v1/chat/completions", json=chat(model, logit_bias={key: 5}))
    assert_error(r, 400, param="logit_bias")
    assert_serving(http, model)


def test_logit_bias_last_valid_id_is_served(http, model, vocab):
    r = http.post("/v1/chat/completions", json=chat(model, logit_bias={str(vocab - 1): 100}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "bias",
    [
        {str(i): 1 for i in range(5000)},  # a huge map
        {"-1": 1},
        {"+5": 1},
        {" 5": 1},
        {"٣": 1},  # a digit, but not an ASCII one
        {"5": 101},
        {"5": -100.5},
    ],
    ids=["huge", "negative", "plus", "space", "arabic-digit", "above-100", "below-minus-100"],
)
def test_logit_bias_malformed(http, model, bias):
    r = http.post("/v1/chat/completions", json=chat(model, logit_bias=bias))
    assert_error(r, 400, param="logit_bias")
    assert_serving(http, model)


def test_token_prompt_outside_the_vocabulary(http, model, vocab):
    for ids in ([vocab], [1, 2, 2**40], [-1]):
        r = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 2})
        assert_error(r, 400, param="prompt")
    assert_serving(http, model)


def test_top_k_larger_than_the_vocabulary(http, model, vocab):
    body = chat(model, temperature=1.0, top_k=vocab + 1)
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="top_k")
    body = chat(model, temperature=1.0, top_k=vocab)
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---------------------------------------------------------------- numbers and nesting


@pytest.mark.parametrize("seed", [-1, -(2**63), 0, 2**63, 2**64 - 1])
def test_seeds_in_the_documented_range_are_served(http, model, seed):
    r = http.post("/v1/chat/completions", json=chat(model, seed=seed))
    assert r.status_code == 200, r.text
    assert r.headers["x-mlxd-lane"] == "serial; reason=seed"


def test_negative_seed_is_the_same_as_its_unsigned_twin(http, model):
    body = chat(model, temperature=1.0, max_tokens=8)
    a = http.post("/v1/chat/completions", json={**body, "seed": -1}).json()
    b = http.post("/v1/chat/completions", json={**body, "seed": 2**64 - 1}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seeds_out_of_range(http, model, seed):
    assert_error(http.post("/v1/chat/completions", json=chat(model, seed=seed)), 400, param="seed")
    assert_serving(http, model)


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deeply_nested_body(http, model, depth):
    body = b'{"model": "m", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
    headers = {"content-type": "application/json"}
    r = http.post("/v1/chat/completions", content=body, headers=headers)
    assert_error(r, 400, code="invalid_json")
    assert_serving(http, model)


def test_long_stop_sequence(http, model):
    r = http.post("/v1/chat/completions", json=chat(model, stop=["x" * 501]))
    assert_error(r, 400, param="stop")


# ---------------------------------------------------------------- Host and Origin


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/dashboard"),
        ("GET", "/dashboard/config"),
        ("GET", "/stats"),
        ("GET", "/metrics"),
        ("POST", "/admin/reload"),
        ("GET", "/no/such/route"),
    ],
)
def test_foreign_host_is_refused_everywhere(http, model, method, path):
    for host in ("evil.example:8080", "evil.example", "127.0.0.1.evil.example", "localhost.evil"):
        r = http.request(
            method,
            path,
            json=chat(model) if method == "POST" else None,
            headers={"host": host, "origin": f"http://{host}"},
        )
        assert_error(r, 421, code="host_not_allowed")


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "localhost", "[::1]", "192.168.1.20", ALLOWED, "api.proxy.example"]
)
def test_allowed_hosts_are_served(http, daemon, host):
    r = http.get("/v1/models", headers={"host": f"{host}:{daemon.port}"})
    assert r.status_code == 200, r.text


def test_rebinding_page_cannot_apply_a_config(http, daemon):
    # What a DNS-rebinding page sends: its own name as Host and Origin.
    before = daemon.config_path.read_text()
    evil = f"evil.example:{daemon.port}"
    r = http.post(
        "/dashboard/config/apply",
        data={"text": before + "\n# pwned\n"},
        headers={"host": evil, "origin": f"http://{evil}"},
    )
    assert r.status_code == 421
    r = http.post("/admin/reload", headers={"host": evil, "origin": f"http://{evil}"})
    assert r.status_code == 421
    assert daemon.config_path.read_text() == before


def test_admin_origin_must_be_allowed_and_match(http, daemon):
    own = f"127.0.0.1:{daemon.port}"
    r = http.post("/admin/reload", headers={"host": own, "origin": f"http://{own}"})
    assert r.status_code == 200, r.text
    for origin in (f"http://evil.example:{daemon.port}", "null", "http://127.0.0.1:1"):
        r = http.post("/admin/reload", headers={"host": own, "origin": origin})
        assert_error(r, 403, code="cross_site")


# ---------------------------------------------------------------- content types


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ],
)
def test_simple_cross_site_bodies_are_refused(http, model, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps(chat(model)).encode()
    for path in ("/v1/chat/completions", "/v1/completions"):
        request = http.build_request("POST", path, content=body, headers=headers)
        assert request.headers.get("content-type") == content_type
        assert_error(http.send(request), 415, code="unsupported_media_type")


def test_json_content_types_are_accepted(http, model):
    body = json.dumps(chat(model)).encode()
    for ct in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": ct})
        assert r.status_code == 200, (ct, r.text)


def test_anthropic_route_answers_in_anthropic_shape(http):
    r = http.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- slow clients


def _raw(daemon, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_body_that_stops_arriving_gets_408(http, daemon, model):
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    started = time.monotonic()
    sock = _raw(daemon, head + b'{"model": ')
    assert_serving(http, model)  # others are served meanwhile
    answer = _read_all(sock)
    elapsed = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer
    assert elapsed < 5, elapsed


@pytest.mark.parametrize("sent", [b"", b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_headers_that_never_finish_are_cut_off(http, daemon, model, sent):
    started = time.monotonic()
    sock = _raw(daemon, sent)
    assert_serving(http, model)
    answer = _read_all(sock)
    elapsed = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert elapsed < 5, elapsed


def test_slowloris_dribble_is_cut_off(daemon):
    sock = _raw(daemon, b"GET /v1/models HTTP/1.1\r\n")
    started = time.monotonic()
    closed = False
    for _ in range(40):  # one header byte every 0.1 s would last for ever
        try:
            sock.sendall(b"X")
            time.sleep(0.1)
        except OSError:
            closed = True
            break
        sock.settimeout(0.01)
        try:
            if sock.recv(1024).startswith(b"HTTP/1.1 408"):
                closed = True
                break
        except TimeoutError:
            pass
    sock.close()
    assert closed and time.monotonic() - started < 3


def _answer_and_close(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sends, and whether it closed the connection within ``within`` s."""
    sock.settimeout(within)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks), True
    except TimeoutError:
        return b"".join(chunks), False


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/dashboard/models/load", "application/x-www-form-urlencoded"),
        ("/dashboard/models/pin", "application/x-www-form-urlencoded"),
        ("/dashboard/config/validate", "application/x-www-form-urlencoded"),
        ("/dashboard/config/apply", "application/x-www-form-urlencoded"),
        ("/dashboard/login", "application/x-www-form-urlencoded"),
        ("/admin/reload", "application/json"),
        ("/v1/embeddings", "application/json"),
    ],
)
def test_every_body_that_stops_arriving_gets_408_and_the_connection_closes(
    http, daemon, model, path, kind
):
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
        f"Content-Type: {kind}\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    started = time.monotonic()
    sock = _raw(daemon, head + b"model=a&on=tr")
    assert_serving(http, model)  # others are served meanwhile
    answer, closed = _answer_and_close(sock, 10)
    elapsed = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer and b"connection: close" in answer.lower()
    assert closed and elapsed < 5, elapsed


def test_many_stalled_bodies_are_all_cut_off_while_health_answers(http, daemon, model):
    head = (
        f"POST /dashboard/config/apply HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\nraw="
    ).encode()
    socks = [_raw(daemon, head) for _ in range(48)]
    try:
        assert http.get("/health").status_code == 200
        assert_serving(http, model)
        answers = [_answer_and_close(sock, 10) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(a.startswith(b"HTTP/1.1 408") and closed for a, closed in answers)


def test_a_body_over_the_limit_that_is_still_being_sent_gets_its_413(daemon):
    # mlxd answers from the declared length without reading the body; the
    # client goes on sending it. Closing with unread bytes would reset the
    # connection and the client would lose the answer: mlxd reads and drops them.
    size = 4 * 2**20 + 1
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    sock = _raw(daemon, head)
    time.sleep(0.3)  # the 413 is on its way before the body
    sent = 0
    try:
        while sent < size:
            sent += sock.send(b"x" * min(65536, size - sent))
    except OSError as exc:  # the connection was reset under the client
        pytest.fail(f"sending the body failed after {sent} bytes: {exc!r}")
    answer, closed = _answer_and_close(sock, 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer and closed


def test_a_chunked_body_over_the_limit_gets_413_and_the_connection_closes(daemon):
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"x" * 65536
    sock = _raw(daemon, head + b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(65)))
    answer, closed = _answer_and_close(sock, 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower() and closed


# ---------------------------------------------------------------- the queue bound


def test_queue_bound_is_exact_for_a_burst(daemon, model):
    # batch.size 4 + max_queued 8: of 16 simultaneous requests, exactly 4 get 429.
    async def burst():
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as client:
            body = chat(model, max_tokens=300)
            return await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(16))
            )

    answers = asyncio.run(burst())
    codes = sorted(r.status_code for r in answers)
    assert codes.count(429) == 4, codes
    assert codes.count(200) == 12, codes
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"


# ---------------------------------------------------------------- logs


def test_untrusted_text_cannot_forge_log_lines(http, daemon):
    forged = "2026-01-01 00:00:00,000 ERROR   mlxd: FORGED"
    # A config key with a newline in it: the reload's rejection logs the key.
    text = daemon.config_path.read_text()
    daemon.write_config(text + f'\n[prompt_cache]\n"max\\n{forged}" = 1\n')
    try:
        r = http.post("/admin/reload")
        assert r.status_code == 400
    finally:
        daemon.write_config(text)
    lines = daemon.log().splitlines()
    assert not any(line.startswith(forged) for line in lines)
    assert any("FORGED" in line for line in lines)  # it was logged, escaped, on one line


# ---------------------------------------------------------------- dashboard bodies


def test_dashboard_forms_are_bounded_too(http, daemon):
    # Litestar parses the dashboard's forms itself: the guard bounds them first,
    # from the declared length alone (the body is never read).
    sock = _raw(
        daemon,
        (
            f"POST /dashboard/config/apply HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n"
            f"Content-Length: {4 * 2**20 + 1}\r\n\r\n"
        ).encode(),
    )
    answer = _read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer

    sock = _raw(
        daemon,
        (
            f"POST /dashboard/login HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode(),
    )
    answer = _read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 411"), answer[:200]
    assert b"length_required" in answer
    r = http.post("/dashboard/login", data={"token": "wrong"})
    assert r.status_code in (401, 403)  # an ordinary form still reaches its handler
