"""Why a prompt missed the cache, against the real daemon: header, usage, /stats, /metrics, rules.

One daemon bound off loopback (reached via 127.0.0.1) with an admin token and
anonymous reading, so /stats has both kinds of reader, serving the same tiny
llama twice: ``tiny`` with the default ``[prompt_cache] volatile_rules`` and
``tiny-raw`` with none. The official ``openai`` and ``anthropic`` clients
read the ``X-Mlxd-Prompt-Cache`` header next to the usage they parse, on all
four generation routes, streamed and not.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxd.api.lookup import parse_header
from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

ADMIN_TOKEN = "adm-test-" + uuid.uuid4().hex
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# About 600 tokens of the tiny byte-level tokenizer: long enough that a miss shows.
SYSTEM = "You are a careful coding agent. Read the files before editing them. " * 12


@pytest.fixture(scope="module")
def daemon(apps) -> Daemon:
    path = str(tiny_model_dir("llama", template="hermes"))  # tools, as agents send
    config = toml_config(
        server={"admin_token": ADMIN_TOKEN, "allow_anonymous_read": True},
        models={
            "tiny": {"path": path, "default": True},
            "tiny-raw": {"path": path, "prompt_cache": {"volatile_rules": []}},
        },
        batch={"size": 2},
        sampling={"max_tokens": 8},
    )
    # Its own: the test reads its log, and the counts must start from zero.
    return apps.get(config, name="prompt-cache-explain", args=["--host", "0.0.0.0"])


def _header(response: Any) -> dict[str, Any]:
    value = response.headers.get("x-mlxd-prompt-cache")
    assert value, f"no X-Mlxd-Prompt-Cache header: {dict(response.headers)}"
    return parse_header(value)


def _openai_counts(raw: Any, stream: bool) -> tuple[dict, int, int]:
    """(header, usage prompt tokens, usage cached tokens) of a chat or text completion."""
    if not stream:
        usage = raw.parse().usage
    else:
        usage = [c.usage for c in raw.parse() if c.usage is not None][-1]
    assert usage is not None and usage.prompt_tokens_details is not None
    return _header(raw), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


# ---------------------------------------------------------------- the header and the usage


def _chat(d: Daemon, stream: bool, user: str) -> tuple[dict, int, int]:
    """(header, usage prompt tokens, usage cached tokens) of one chat completion."""
    client = d.openai(max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    kw: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 4}
    if stream:
        kw |= {"stream": True, "stream_options": {"include_usage": True}}
    raw = client.chat.completions.with_raw_response.create(**kw)
    return _openai_counts(raw, stream)


def _completion(d: Daemon, stream: bool, user: str) -> tuple[dict, int, int]:
    client = d.openai(max_retries=0)
    kw: dict[str, Any] = {"model": "tiny", "prompt": SYSTEM + user, "max_tokens": 4}
    if stream:
        kw |= {"stream": True, "stream_options": {"include_usage": True}}
    raw = client.completions.with_raw_response.create(**kw)
    return _openai_counts(raw, stream)


def _response(d: Daemon, stream: bool, user: str) -> tuple[dict, int, int]:
    client = d.openai(max_retries=0)
    kw: dict[str, Any] = {
        "model": "tiny",
        "instructions": SYSTEM,
        "input": user,
        "max_output_tokens": 4,
        "store": False,
    }
    raw = client.responses.with_raw_response.create(**kw, stream=stream)
    if not stream:
        usage = raw.parse().usage
    else:
        done = [e for e in raw.parse() if e.type in ("response.completed", "response.incomplete")]
        usage = done[-1].response.usage
    assert usage is not None
    return _header(raw), usage.input_tokens, usage.input_tokens_details.cached_tokens


def _message(d: Daemon, stream: bool, user: str) -> tuple[dict, int, int]:
    import anthropic

    client = anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = {
        "model": "tiny",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": 4,
    }
    raw = client.messages.with_raw_response.create(**kw, stream=stream)
    if not stream:
        usage = raw.parse().usage
        return _header(raw), _anthropic_prompt(usage), usage.cache_read_input_tokens or 0
    events = list(raw.parse())
    start = next(e for e in events if e.type == "message_start").message.usage
    final = next(e for e in events if e.type == "message_delta").usage
    # message_start comes after admission: its split is already the real one.
    assert (start.input_tokens, start.cache_read_input_tokens) == (
        final.input_tokens,
        final.cache_read_input_tokens,
    )
    return _header(raw), _anthropic_prompt(final), final.cache_read_input_tokens or 0


def _anthropic_prompt(usage: Any) -> int:
    # Anthropic's split: input_tokens are the prompt tokens not read from the cache.
    return (usage.input_tokens or 0) + (usage.cache_read_input_tokens or 0)


CALLS = {"chat": _chat, "completions": _completion, "responses": _response, "messages": _message}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", list(CALLS))
def test_header_matches_usage_on_every_api(daemon: Daemon, api: str, stream: bool) -> None:
    call = CALLS[api]
    user = f"{api} {stream} {uuid.uuid4().hex[:8]}: list the files."
    call(daemon, stream, "an earlier question with the same system prompt")
    first, prompt1, cached1 = call(daemon, stream, user)
    second, prompt2, cached2 = call(daemon, stream, user)
    for header, prompt, cached in ((first, prompt1, cached1), (second, prompt2, cached2)):
        assert header["prompt"] == prompt, header
        assert header["cached"] == cached, header
    # The same prompt again: everything but the token generation feeds is reused.
    assert second["source"] == "ram" and cached2 == prompt2 - 1, second
    assert "diverged_at" not in second, second
    # The first one left what the cache held where its user turn began.
    assert first["diverged_at"] == cached1 < prompt1, first
    assert cached1 > prompt1 // 2, "the shared system prompt was not reused"


# ---------------------------------------------------------------- /stats: the lookups


def _lookups(d: Daemon, model: str, headers: dict[str, str] | None = None) -> list[dict]:
    stats = httpx.get(f"{d.url}/stats", headers=headers or {}, timeout=10).json()
    entry = next(m for m in stats["fleet"]["models"] if m["id"] == model)
    return entry["engine"]["prompt_cache"]["lookups"]


def test_stats_lookups_show_the_divergence_and_its_text_to_admins_only(daemon: Daemon) -> None:
    marker = "zebra" + uuid.uuid4().hex[:10]
    with daemon.client() as http:
        body = {
            "model": "tiny-raw",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"first question {marker}"},
            ],
        }
        r1 = http.post("/v1/chat/completions", json=body)
        body["messages"][1]["content"] = f"other question {marker}"
        r2 = http.post("/v1/chat/completions", json=body)
    assert r1.status_code == r2.status_code == 200
    header = _header(r2)
    rid = r2.headers["x-request-id"]

    anonymous = next(lk for lk in _lookups(daemon, "tiny-raw") if lk["request_id"] == rid)
    admin = next(lk for lk in _lookups(daemon, "tiny-raw", ADMIN) if lk["request_id"] == rid)
    for lookup in (anonymous, admin):
        assert lookup["model"] == "tiny-raw" and lookup["api"] == "chat"
        assert lookup["cached_tokens"] == header["cached"]
        assert lookup["prompt_tokens"] == header["prompt"]
        assert lookup["diverged_at"] == header["diverged_at"]
        assert lookup["source"] == "ram"
    # Prompt text: null for a reader without the admin token, the text around
    # the point where the two questions part for an admin.
    assert anonymous["before"] is None and anonymous["after"] is None
    assert admin["before"].endswith("<|im_start|>user\n"), admin
    assert admin["after"].startswith("other"), admin
    page = httpx.get(f"{daemon.url}/stats", timeout=10).text
    assert marker not in page and "other question" not in page


# ---------------------------------------------------------------- the billing header rule


def _claude_code_body(model: str, cch: str) -> dict[str, Any]:
    """What Claude Code (2.1.36+) sends: the billing line as system[0], then its prompt."""
    return {
        "model": model,
        "max_tokens": 4,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.100.a1b; "
                f"cc_entrypoint=cli; cch={cch};",
            },
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {
                "name": "Read",
                "description": "Read a file from the local filesystem.",
                "input_schema": {
                    "type": "object",
                    "properties": {"file_path": {"type": "string"}},
                    "required": ["file_path"],
                },
            }
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in main.py?"}]}
        ],
        "metadata": {"user_id": "user_abc_account__session_1234"},
    }


def _send_claude_code(d: Daemon, model: str, cch: str) -> httpx.Response:
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
    with (
        d.client() as http,
        http.stream(
            "POST", "/v1/messages", json=_claude_code_body(model, cch), headers=headers
        ) as r,
    ):
        r.read()
        return r


def test_claude_billing_header_rule_makes_the_second_turn_hit(daemon: Daemon) -> None:
    on = [_send_claude_code(daemon, "tiny", cch) for cch in ("3f2a1", "9c0d7")]
    off = [_send_claude_code(daemon, "tiny-raw", cch) for cch in ("3f2a1", "9c0d7")]
    assert all(r.status_code == 200 for r in on + off)

    # The rule on: both prompts are the same once the line is gone, so the
    # second reuses all of the first.
    hit = _header(on[1])
    assert hit["cached"] == hit["prompt"] - 1 and "diverged_at" not in hit, hit
    assert all(r.headers["x-mlxd-prompt-rules"] == "claude_billing_header" for r in on)
    # The rule off: the prompts part at the cch value, a few dozen tokens in.
    miss = _header(off[1])
    assert miss["prompt"] > 500 and miss["diverged_at"] == miss["cached"] < 60, miss
    assert all("x-mlxd-prompt-rules" not in r.headers for r in off)
    # The rule's count (/stats and /metrics) and the log line say it too.
    stats = httpx.get(f"{daemon.url}/stats", headers=ADMIN, timeout=10).json()
    models = {m["id"]: m["engine"]["prompt_cache"] for m in stats["fleet"]["models"]}
    assert models["tiny"]["rules"] == {"claude_billing_header": 2}
    assert models["tiny-raw"]["rules"] == {}
    lookup = next(
        lk for lk in models["tiny-raw"]["lookups"] if lk["cached_tokens"] == miss["cached"]
    )
    assert lookup["after"].startswith("9c0d7"), lookup  # the admin sees what changed
    metrics = httpx.get(f"{daemon.url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
    }
    key = (
        "mlxd_prompt_rules_applied_total",
        (("model", "tiny"), ("rule", "claude_billing_header")),
    )
    assert samples[key] == 2
    assert "rules=claude_billing_header" in daemon.log()


def test_count_tokens_applies_the_same_rule(daemon: Daemon) -> None:
    """count_tokens equals the prompt the real request runs, billing line removed."""
    body = _claude_code_body("tiny", "77aa1")
    del body["stream"], body["max_tokens"], body["metadata"]
    with daemon.client() as http:
        counted = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        real = _send_claude_code(daemon, "tiny", "77aa1")
        raw_count = http.post(
            "/v1/messages/count_tokens", json={**body, "model": "tiny-raw"}
        ).json()["input_tokens"]
    assert counted == _header(real)["prompt"]
    assert raw_count > counted  # the line is tokens too, when nothing removes it


# ---------------------------------------------------------------- /metrics agrees with /stats


def test_metrics_count_tokens_served_by_tier(daemon: Daemon) -> None:
    _chat(daemon, False, "metrics turn")
    _chat(daemon, False, "metrics turn")
    stats = httpx.get(f"{daemon.url}/stats", timeout=10).json()
    metrics = httpx.get(f"{daemon.url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
    }
    pc = next(m for m in stats["fleet"]["models"] if m["id"] == "tiny")["engine"]["prompt_cache"]
    ram = samples[("mlxd_prompt_cache_served_tokens_total", (("model", "tiny"), ("tier", "ram")))]
    disk = samples[("mlxd_prompt_cache_served_tokens_total", (("model", "tiny"), ("tier", "disk")))]
    assert ram == pc["ram_tokens"] > 0
    assert disk == pc["disk_tokens"]
    for name, key in (
        ("mlxd_prompt_cache_checkpoint_writes_total", "checkpoints"),
        ("mlxd_prompt_cache_corrupt_dropped_total", "disk_corrupt"),
        ("mlxd_prompt_cache_disk_bytes", "disk_bytes"),
        ("mlxd_prompt_cache_disk_entries", "disk_entries"),
    ):
        assert samples[(name, (("model", "tiny"),))] == pc[key], name
