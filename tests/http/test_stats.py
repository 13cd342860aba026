"""``GET /stats`` against the real daemon: the documented schema under real load.

docs/api.md is the schema: every field it lists must be in /stats with
that type, and every field /stats has must be listed there. The counts must
add up in every snapshot, and no prompt text or secret may ever appear.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config
from tests.support.stats_schema import check_schema, documented_fields
from tests.support.tinymodels import tiny_model_dir

API_KEY = "sk-test-" + uuid.uuid4().hex
ADMIN_TOKEN = "adm-test-" + uuid.uuid4().hex
BATCH = 2
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def daemon(apps):
    config = toml_config(
        server={"api_keys": [API_KEY], "admin_token": ADMIN_TOKEN, "allow_anonymous_read": True},
        model={"path": str(tiny_model_dir("llama")), "name": MODEL},
        batch={"size": BATCH},
    )
    # Its own: the counters must add up from zero, and a test sends SIGHUP. Bound off
    # loopback (reached via 127.0.0.1), so a reader without the admin token is no admin.
    return apps.get(config, name="stats", args=["--host", "0.0.0.0"])


# ---------------------------------------------------------------- helpers


def chat(d: Daemon, content: str, *, max_tokens: int, seed: int | None = None) -> dict[str, Any]:
    """One streamed chat completion; returns the status and the text it streamed."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    if seed is not None:
        body["seed"] = seed
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = []
    with (
        httpx.Client(base_url=d.url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                text.append(choices[0].get("delta", {}).get("content") or "")
        return {"status": r.status_code, "text": "".join(text)}


def in_background(fn, *args, **kw) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out.update(fn(*args, **kw))
        except Exception as exc:  # reported by the test, not lost in the thread
            out["error"] = repr(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def check_counts(s: dict[str, Any]) -> None:
    b, c = s["batch"], s["counters"]
    assert b["active_rows"] == len(s["rows"])
    assert b["pending_rows"] == len(s["pending"])
    assert b["active_rows"] <= b["configured"] == BATCH
    assert b["prefilling_rows"] == sum(r["phase"] == "prefill" for r in s["rows"])
    assert c["finished"] == sum(sum(lane.values()) for lane in c["requests"].values())
    assert b["active_rows"] + b["pending_rows"] + c["finished"] == c["submitted"], (b, c)


# ---------------------------------------------------------------- tests


def test_stats_schema_and_counts_under_load(daemon: Daemon) -> None:
    fields = documented_fields()
    seen: set[str] = set()
    before = daemon.wait_idle()
    clients = [in_background(chat, daemon, f"count to {i} " * 8, max_tokens=300) for i in range(5)]
    seeded = None
    max_rows = max_pending = 0
    ids: set[str] = set()
    slowest = 0.0
    with httpx.Client(base_url=daemon.url, timeout=10) as http:
        while any(t.is_alive() for t, _ in clients) or (seeded and seeded[0].is_alive()):
            started = time.monotonic()
            s = http.get("/stats").json()
            slowest = max(slowest, time.monotonic() - started)
            check_schema(s, fields, seen)
            check_counts(s)
            max_rows = max(max_rows, s["batch"]["active_rows"])
            max_pending = max(max_pending, s["batch"]["pending_rows"])
            ids |= {r["id"] for r in s["rows"]} | {p["id"] for p in s["pending"]}
            if seeded is None and any(r["lane"] == "batch" for r in s["rows"]):
                # A seeded request goes to the serial lane and drains the running batch.
                seeded = in_background(chat, daemon, "seeded", max_tokens=40, seed=7)
                daemon.signal(signal.SIGHUP)  # a reload event ("unchanged")
            time.sleep(0.02)
    for _, out in [*clients, seeded]:
        assert out.get("status") == 200, out
    after = daemon.wait_idle()
    check_schema(after, fields, seen)
    check_counts(after)

    assert max_rows == BATCH, "the rows never filled the batch"
    assert max_pending >= 1, "nothing was ever seen waiting"
    assert len(ids) == 6
    assert after["counters"]["finished"] - before["counters"]["finished"] == 6
    assert after["counters"]["submitted"] - before["counters"]["submitted"] == 6
    assert after["drains"] and after["drains"][0]["reason"] == "seed"
    assert after["drains"][0]["ended_at"] is not None
    assert after["reloads"] and after["reloads"][0]["trigger"] == "SIGHUP"
    assert after["rows"] == [] and after["pending"] == []
    # An open batch's fields are seen by tests/http/test_batches.py, which runs batches;
    # API keys and preemptions need a daemon with keys: tests/http/test_priority.py sees them;
    # a repo model's download job needs a hub: tests/daemon/test_hub.py sees it.
    elsewhere = {
        f
        for f in fields
        if f.startswith(("batches.batches[]", "keys[].", "preemptions[].", "downloads[]."))
        or f == "fleet.models[].download"
    }
    missing = set(fields) - seen - elsewhere
    assert not missing, f"documented but never seen in /stats: {sorted(missing)}"
    # Reading takes the published snapshot; it never queues behind the engine loop.
    assert slowest < 2.0, f"a /stats read took {slowest:.2f}s"


def test_stats_and_dashboard_never_show_prompts_or_secrets_to_non_admins(daemon: Daemon) -> None:
    marker = "zebra-marker-" + uuid.uuid4().hex
    thread, out = in_background(chat, daemon, f"Please repeat {marker} forever", max_tokens=400)
    pages = []
    with httpx.Client(base_url=daemon.url, timeout=10) as http:
        saw_row = False
        while thread.is_alive():
            stats = http.get("/stats")
            saw_row |= bool(stats.json()["rows"])
            pages += [stats.text, http.get("/dashboard").text, http.get("/metrics").text]
            pages += [http.get(f"/dashboard/{r}").text for r in ("active-rows", "pending-queue")]
            time.sleep(0.05)
        thread.join()
        pages += [http.get(p).text for p in ("/stats", "/dashboard", "/metrics")]
    assert out.get("status") == 200, out
    assert saw_row, "the request finished before /stats showed it"
    secrets = {"prompt marker": marker, "API key": API_KEY, "admin token": ADMIN_TOKEN}
    if len(out["text"]) >= 24:  # long enough not to occur by chance
        secrets["completion text"] = out["text"]
    for name, secret in secrets.items():
        leaks = [page[:200] for page in pages if secret in page]
        assert not leaks, f"the {name} appears in /stats or the dashboard: {leaks[0]!r}"
    # An admin sees the prompt-cache lookup's snippet (the prompt's start, here: a
    # miss at token 0), and still no key, token or completion text.
    admin = httpx.get(
        f"{daemon.url}/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    ).text
    assert "Please repeat" in admin
    for name in ("API key", "admin token", "completion text"):
        if name in secrets:
            assert secrets[name] not in admin, f"the {name} appears in /stats for an admin"


def test_stats_shows_no_server_paths_to_non_admins(daemon: Daemon) -> None:
    model_dir = str(tiny_model_dir("llama"))
    anonymous = httpx.get(f"{daemon.url}/stats", timeout=10).text
    assert model_dir not in anonymous and str(daemon.config_path) not in anonymous
    assert '"<path>"' in anonymous
    admin = httpx.get(
        f"{daemon.url}/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    ).text
    assert model_dir in admin


def test_admin_memory_answers_admins_only(daemon: Daemon) -> None:
    assert httpx.get(f"{daemon.url}/admin/memory", timeout=10).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=daemon.url, headers=admin, timeout=60) as http:
        assert http.post("/admin/memory/baseline").status_code == 200
        body = http.get("/admin/memory", params={"limit": 5}).json()
        assert body["rss_bytes"] > 0 and body["objects"] > 0
        assert len(body["object_types_grown"]) <= 5 and body["tracemalloc"] is None
        trim = http.post("/admin/memory/trim").json()
        assert trim["rss_after_bytes"] > 0 and isinstance(trim["malloc_trim"], bool)


def test_stats_serves_a_fresh_snapshot_without_caching(daemon: Daemon) -> None:
    first = httpx.get(f"{daemon.url}/stats")
    time.sleep(0.6)  # the idle engine republishes at least every 0.5 s
    second = httpx.get(f"{daemon.url}/stats")
    assert first.headers["content-type"].startswith("application/json")
    assert first.headers["cache-control"] == "no-store"
    assert second.json()["taken_at"] > first.json()["taken_at"]
    assert second.json()["uptime_s"] > first.json()["uptime_s"]
