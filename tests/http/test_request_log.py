"""The per-request log line and the ``[server] unknown_parameters`` switch, on a real daemon."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

LINE = re.compile(r"INFO    mlxd\.requests: (.*)$", re.M)


def _config(model_dir, **server) -> str:
    return toml_config(
        server={"log_level": "info", **server},
        model={"path": str(model_dir)},
        batch={"size": 2},
        sampling={"temperature": 0.0},
    )


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    # Its own: the tests reconfigure it and count lines in its log.
    return apps.get(_config(tiny_models("llama")), name="request-log")


@pytest.fixture(autouse=True)
def _lines_settled(daemon: Daemon):
    """Each test's requests have logged their lines before the next test counts them.

    A request's line is written once its response is sent, so a test's last line can
    land after its client has read the answer (in process, the server thread logs it
    while the next test has already started counting).
    """
    yield
    deadline = time.monotonic() + 5
    seen, since = len(_posts(daemon)), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 0.3:
        time.sleep(0.05)
        count = len(_posts(daemon))
        if count != seen:
            seen, since = count, time.monotonic()


def _reconfigure(d: Daemon, **server) -> None:
    d.write_config(_config(tiny_model_dir("llama"), **server))
    assert d.reload().json()["outcome"] in ("applied", "unchanged")


def _chat(d: Daemon, **extra) -> httpx.Response:
    body = {
        "model": d.model_id(),
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        **extra,
    }
    return httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=60)


def _posts(d: Daemon) -> list[str]:
    """The request lines of completions (GET /v1/models is logged too)."""
    return [line for line in LINE.findall(d.log()) if line.startswith("POST")]


def _new_lines(d: Daemon, before: int, want: int, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        lines = _posts(d)[before:]
        if len(lines) >= want or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_one_info_line_per_request(daemon: Daemon) -> None:
    model = daemon.model_id()
    before = len(_posts(daemon))
    assert _chat(daemon).status_code == 200
    with httpx.stream(
        "POST",
        f"{daemon.url}/v1/completions",
        json={"model": model, "prompt": "once upon", "max_tokens": 4, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    assert _chat(daemon, model="no-such-model").status_code == 404
    lines = _new_lines(daemon, before, 3)
    assert len(lines) == 3, lines
    chat, stream, missing = lines
    assert re.fullmatch(
        rf"POST /v1/chat/completions 200 model={re.escape(model)} lane=batch prompt=\d+ "
        r"cached=\d+( diverged_at=\d+)? "
        r"generated=[1-5] finish=(length|stop) ttft=\d+\.\d{3}s duration=\d+\.\d{3}s",
        chat,
    ), chat
    assert stream.startswith(f"POST /v1/completions 200 model={model} lane=batch prompt=")
    assert "generated=" in stream and "ttft=" in stream
    assert missing.startswith(
        "POST /v1/chat/completions 404 model=no-such-model error=model_not_found duration="
    )
    assert "hello" not in daemon.log()  # counts only, never the prompt
    assert re.search(r"mlxd\.requests: GET /v1/models 200 duration=", daemon.log())

    _reconfigure(daemon, log_requests=False)
    before = len(_posts(daemon))
    assert _chat(daemon).status_code == 200
    assert _new_lines(daemon, before, 1, timeout=1.0) == []
    _reconfigure(daemon)


def test_unknown_parameters_are_refused_by_default(daemon: Daemon) -> None:
    r = _chat(daemon, frobnicate=True)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("unknown_parameter", "frobnicate")
    assert "x-mlxd-ignored-parameters" not in r.headers


def test_ignore_drops_and_lists_them_but_unsupported_stays_a_400(daemon: Daemon) -> None:
    _reconfigure(daemon, unknown_parameters="ignore", log_level="debug")
    try:
        extras = {"frobnicate": True, "litellm_session_id": "abc", "bad\r\nname": 1}
        r = _chat(daemon, **extras)
        assert r.status_code == 200, r.text
        assert r.headers["x-mlxd-ignored-parameters"] == "frobnicate, litellm_session_id, (1 more)"
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        assert "ignored unknown parameters" in daemon.log()

        # The openai SDK's extra_body, as clients with vendor extras send it.
        raw = daemon.openai().chat.completions.with_raw_response.create(
            model=daemon.model_id(),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body={"top_a": 0.1},
        )
        assert raw.headers["x-mlxd-ignored-parameters"] == "top_a"

        # Known but not supported: still refused, ignore or not.
        n = _chat(daemon, n=2, frobnicate=True)
        assert n.status_code == 400 and n.json()["error"]["code"] == "unsupported_parameter"
        assert n.json()["error"]["param"] == "n"
        # Nested objects stay strict.
        nested = _chat(daemon, stream=True, stream_options={"include_usage": True, "x": 1})
        assert nested.status_code == 400
        assert nested.json()["error"]["code"] == "unknown_parameter"
        # Plain requests carry no header.
        assert "x-mlxd-ignored-parameters" not in _chat(daemon).headers
    finally:
        _reconfigure(daemon)
    assert _chat(daemon, frobnicate=True).status_code == 400


def _line_after(d: Daemon, before: int, start: str) -> str:
    lines = _new_lines(d, before, 1)
    assert len(lines) == 1 and lines[0].startswith(start), lines
    return lines[0]


def test_a_stream_the_client_left_is_logged_cancelled_with_what_it_generated(
    daemon: Daemon,
) -> None:
    """Issue 22: it was logged 200 with no generated/finish."""
    before = len(_posts(daemon))
    body = {
        "model": daemon.model_id(),
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2000,
        "stream": True,
    }
    with httpx.stream("POST", f"{daemon.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 4:
                break  # leave mid-stream
    line = _line_after(daemon, before, "POST /v1/chat/completions 499 ")
    generated = int(re.search(r" generated=(\d+) ", line)[1])  # type: ignore[index]
    assert 3 <= generated < 2000, line
    assert " error=cancelled " in line and "finish=" not in line


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2},
         "unsupported_parameter"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
         "invalid_value"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "invalid_value"),
        ("/v1/chat/completions", {"messages": []}, "invalid_value"),
    ],
)  # fmt: skip
def test_every_4xx_line_carries_the_error_code(daemon: Daemon, path, body, code) -> None:
    before = len(_posts(daemon))
    r = httpx.post(f"{daemon.url}{path}", json={"model": daemon.model_id(), **body}, timeout=60)
    assert r.status_code == 400, r.text
    line = _line_after(daemon, before, f"POST {path} 400 ")
    assert f" error={code} " in line, (line, r.text)
    if path != "/v1/messages":  # Anthropic's envelope has no code, only the log line does
        assert r.json()["error"]["code"] == code, r.text


def test_the_serial_lane_says_why(daemon: Daemon) -> None:
    before = len(_posts(daemon))
    r = _chat(daemon, seed=7)
    assert r.status_code == 200
    lane = r.headers["x-mlxd-lane"]
    assert lane.startswith("serial"), lane
    line = _line_after(daemon, before, "POST /v1/chat/completions 200 ")
    reason = lane.split("reason=", 1)[1] if "reason=" in lane else lane.split(";")[-1].strip()
    assert f" lane=serial reason={reason} " in line, (line, lane)


def test_without_an_embedding_model_the_error_says_how_to_add_one(daemon: Daemon) -> None:
    before = len(_posts(daemon))
    r = httpx.post(f"{daemon.url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 404, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("This server has no embedding model. Add one: a [models.<id>]")
    assert 'kind = "embedding"' in message and "configuration.md#embedding-models" in message
    assert " error=model_not_found " in _line_after(daemon, before, "POST /v1/embeddings 404 ")
