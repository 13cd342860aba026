"""The Responses store through the daemon: owned by API keys, bounded by bytes, and
memory handed back when its entries expire.

With two keys, the second could once read, continue and delete the first's
stored responses, and stored responses of a few MB each grew the daemon by a
gigabyte that stayed after they expired. Now each response is its key's
alone, the store keeps to ``[responses] max_bytes``, and the daemon's resident
memory comes back down once the entries' ``ttl`` has passed, with no request
to trigger it.
"""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config

K1, K2 = "key-one", "key-two"
TTL = 4.0
MAX_BYTES = 8 * 2**20


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models) -> Daemon:
    config = toml_config(
        server={"api_keys": [K1, K2]},
        model={"path": str(tiny_models("llama")), "name": "tiny", "max_context": 128},
        batch={"size": 4},
        limits={"max_body_bytes": "4MiB"},
        responses={"ttl": TTL, "max_bytes": "8MiB", "max_stored": 64},
        sampling={"temperature": 0.0},
    )
    return daemons.get(config, name="responses-store")


def client(d: Daemon, key: str) -> httpx.Client:
    return httpx.Client(base_url=d.url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def create(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 3, **body})


def rss_bytes(d: Daemon) -> int:
    assert d.proc is not None
    out = subprocess.run(
        ["ps", "-o", "rss=", "-p", str(d.proc.pid)], capture_output=True, text=True
    )
    return int(out.stdout.strip()) * 1024


def test_a_stored_response_belongs_to_the_key_that_created_it(daemon: Daemon):
    with client(daemon, K1) as one, client(daemon, K2) as two:
        r = create(one, input="remember this")
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert one.get(f"/v1/responses/{rid}").json()["id"] == rid
        # Another key: as if it never existed, whatever it tries.
        got = two.get(f"/v1/responses/{rid}")
        assert got.status_code == 404 and got.json()["error"]["code"] == "response_not_found"
        cont = create(two, input="and?", previous_response_id=rid)
        assert cont.status_code == 400, cont.text
        assert cont.json()["error"]["code"] == "previous_response_not_found"
        assert two.delete(f"/v1/responses/{rid}").status_code == 404
        # Its owner still has it, continues it and deletes it.
        assert create(one, input="and?", previous_response_id=rid).status_code == 200
        assert one.delete(f"/v1/responses/{rid}").json()["deleted"] is True
        assert one.get(f"/v1/responses/{rid}").status_code == 404


def test_metadata_past_openais_limits_is_refused(daemon: Daemon):
    with client(daemon, K1) as http:
        r = create(http, input="hi", metadata={"k": "v" * 3_500_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.k", r.text[:300]
        r = create(http, input="hi", metadata={f"k{i}": "v" for i in range(17)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
        r = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "metadata": {"k" * 65: "v"},
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
        assert create(http, input="hi", metadata={"k": "v" * 512}).status_code == 200


def test_a_prompt_past_the_context_names_input(daemon: Daemon):
    with client(daemon, K1) as http:
        r = create(http, input="word " * 400)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", "input")


def test_the_store_keeps_to_max_bytes_and_hands_memory_back_when_entries_expire(daemon: Daemon):
    big = "x" * (3 * 2**20)  # echoed in the stored Response (its `user`)
    with client(daemon, K1) as http:
        for _ in range(2):  # warm up: the first large bodies grow the heap once
            assert create(http, input="hi", user=big, store=False).status_code == 200
        time.sleep(0.5)
        baseline = rss_bytes(daemon)
        for i in range(24):
            r = create(http, input=f"turn {i}", user=big)
            assert r.status_code == 200, r.text[:200]
        stats = http.get("/stats").json()["responses"]
        assert stats["bytes"] <= MAX_BYTES and stats["max_bytes"] == MAX_BYTES
        assert stats["stored"] == 2  # two 3 MiB responses fit in 8 MiB, not three
        full = rss_bytes(daemon)
        time.sleep(TTL + 2)  # no request meanwhile: the entries leave on their own
        assert http.get("/stats").json()["responses"] == {
            "stored": 0,
            "bytes": 0,
            "max_stored": 64,
            "max_bytes": MAX_BYTES,
        }
    after = rss_bytes(daemon)
    mib = 2**20
    print(f"RSS: baseline {baseline / mib:.0f} MiB, full {full / mib:.0f}, after {after / mib:.0f}")
    # 24 responses of 3 MiB were 72 MiB of stored text once; the store held at
    # most 8 MiB of it, and what it held went back after the ttl.
    assert full - baseline < 48 * mib, (baseline, full)
    assert after - baseline < 24 * mib, (baseline, after)
