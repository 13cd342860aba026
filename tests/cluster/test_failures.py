"""A cluster never hangs: a lost rank, a rank that never joins, a model it cannot shard.

Each test runs real ``mlxd serve`` ranks on 127.0.0.1 (``ring`` backend,
tiny models) and checks what an operator and a client see: exit codes,
/ready, error events, and log lines that say what happened.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from tests.support.cluster import Cluster, cluster_config, write_hostfile
from tests.support.ports import free_port


def _stream(url: str, model: str, prompt: list[int]) -> dict:
    """Stream a long completion; return what the client saw, never hang."""
    seen = {"tokens": 0, "error": None, "status": None, "done": False}
    body = {"model": model, "prompt": prompt, "max_tokens": 3000, "stream": True}
    try:
        with (
            httpx.Client(base_url=url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            seen["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    seen["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    seen["error"] = event["error"]
                    break
                seen["tokens"] += 1
    except httpx.HTTPError as exc:
        seen["error"] = {"transport": repr(exc)}
    return seen


def _plain(url: str, model: str, prompt: list[int]) -> dict:
    """A non-streaming completion: the status and error code it ended with."""
    body = {"model": model, "prompt": prompt, "max_tokens": 3000}
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    except httpx.HTTPError as exc:
        return {"status": None, "error": {"transport": repr(exc)}}
    return {"status": r.status_code, "error": r.json().get("error")}


def test_kill_9_of_rank_1_under_load(tmp_path, tiny_models):
    hostfile = write_hostfile(tmp_path, 2)
    config = cluster_config(tiny_models("llama"), hostfile, cluster={"step_timeout": 20.0})
    c = Cluster(tmp_path, config).start()
    try:
        url = c.rank0.url
        model = c.rank0.model_id()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(_stream, url, model, [5 + i, 17, 42]) for i in range(3)]
            plain = pool.submit(_plain, url, model, [9, 17, 42])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rows = c.rank0.stats()["rows"]
                if len(rows) == 4 and all(r["generated_tokens"] >= 2 for r in rows):
                    break
                time.sleep(0.05)
            killed_at = time.monotonic()
            c.ranks[1].proc.send_signal(signal.SIGKILL)
            not_ready = None
            while time.monotonic() - killed_at < 10:
                try:
                    r = httpx.get(f"{url}/ready", timeout=2)
                except httpx.HTTPError:
                    break  # rank 0 already exited
                if r.status_code == 503:
                    not_ready = r.json()
                    break
                time.sleep(0.05)
            code = c.wait_exit(0, 30)
            took = time.monotonic() - killed_at
            seen = [f.result(timeout=30) for f in clients]
            answered = plain.result(timeout=30)
        assert code not in (None, 0), c.logs()
        # About 2 s on an idle machine: the collective raises, or (when MLX's ring leaves it
        # waiting) the watchdog sees the closed link within a second; then 1 s to flush errors.
        assert took < 20, took
        lost = [line for line in c.rank0.log().splitlines() if "cluster lost" in line]
        assert lost and "step_timeout" not in lost[0], lost
        assert not_ready is None or "cluster peer_lost" in not_ready["reason"], not_ready
        for s in seen:
            assert not s["done"], s  # nobody got a normal end of stream
            assert s["error"] is not None, s
        assert answered["status"] == 503 and answered["error"]["code"] == "peer_lost", answered
        explicit = [s for s in seen if "code" in (s["error"] or {})]
        assert explicit and all(s["error"]["code"] == "peer_lost" for s in explicit), seen
        log = c.rank0.log()
        assert "peer" in log and f"exiting with status {code}" in log
    finally:
        c.stop()


def test_kill_9_of_rank_0_ends_the_follower_long_before_step_timeout(tmp_path, tiny_models):
    hostfile = write_hostfile(tmp_path, 2)
    config = cluster_config(tiny_models("llama"), hostfile, cluster={"step_timeout": 30.0})
    c = Cluster(tmp_path, config).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            client = pool.submit(_stream, c.rank0.url, c.rank0.model_id(), [5, 17, 42])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rows = c.rank0.stats()["rows"]
                if rows and rows[0]["generated_tokens"] >= 2:
                    break
                time.sleep(0.05)
            killed_at = time.monotonic()
            c.ranks[0].proc.send_signal(signal.SIGKILL)
            code = c.wait_exit(1, 40)
            took = time.monotonic() - killed_at
            assert client.result(timeout=30)["error"] is not None
        assert code == 3, c.logs()
        assert took < 15, took
        log = c.ranks[1].log()
        assert "exiting with status 3" in log and "for more than step_timeout" not in log, log
    finally:
        c.stop()


def test_a_hung_rank_trips_the_step_watchdog(tmp_path, tiny_models):
    """SIGSTOP keeps rank 1's sockets open: collectives block instead of failing."""
    hostfile = write_hostfile(tmp_path, 2)
    # 6 s, not less: a loaded 2-core VM was seen stalling every process for ~4 s at once,
    # which tripped a 3 s watchdog before the SIGSTOP.
    config = cluster_config(tiny_models("llama"), hostfile, cluster={"step_timeout": 6.0})
    c = Cluster(tmp_path, config).start()
    try:
        model = c.rank0.model_id()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            client = pool.submit(_stream, c.rank0.url, model, [5, 17, 42])
            c.rank0.wait_rows(1, tokens=2)  # the stream decodes across both ranks
            c.ranks[1].proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            seen = client.result(timeout=30)
        code = c.wait_exit(0, 20)
        assert code == 3, c.logs()
        assert time.monotonic() - stopped_at < 20
        assert seen["error"]["code"] == "peer_lost", seen
        assert "step_timeout (6s)" in seen["error"]["message"]
    finally:
        if c.ranks[1].proc.poll() is None:
            c.ranks[1].proc.send_signal(signal.SIGKILL)
        c.stop()


def test_a_rank_that_never_joins_fails_startup_naming_it(tmp_path, tiny_models):
    hostfile = write_hostfile(tmp_path, 2)
    config = cluster_config(tiny_models("llama"), hostfile, cluster={"join_timeout": 3.0})
    c = Cluster(tmp_path, config).start(only=[0], wait_ready=False)
    try:
        started = time.monotonic()
        code = c.wait_exit(0, 60)
        # init() holds the GIL while it waits: a watcher process ends it (SIGKILL).
        assert code == -signal.SIGKILL, c.logs()
        assert time.monotonic() - started < 60
        port1 = json.loads(hostfile.read_text())[1][0]
        log = c.rank0.log()
        assert "join_timeout (3s)" in log and f"rank 1 at {port1}" in log, log
    finally:
        c.stop()


def test_a_ring_address_on_rank_0s_http_port_is_refused_at_start(tmp_path, tiny_models):
    hostfile = tmp_path / "hosts.json"
    config = cluster_config(tiny_models("llama"), hostfile)
    c = Cluster(tmp_path, config)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{c.rank0.port}"]]))
    c.start(only=[0], wait_ready=False)
    try:
        assert c.wait_exit(0, 30) == 2, c.logs()
        assert "which is the port rank 0 serves HTTP on" in c.rank0.log(), c.rank0.log()
    finally:
        c.stop()


@pytest.mark.parametrize(
    ("family", "sharding", "needle"),
    [
        ("llama_b", "tensor", "num_key_value_heads (3) to be a multiple of 2"),
        ("mamba2", "auto", "supports neither tensor sharding"),
        ("qwen3_5", "pipeline", "model.safetensors.index.json"),
    ],
)
def test_startup_refuses_what_cannot_work(tmp_path, tiny_models, family, sharding, needle):
    hostfile = write_hostfile(tmp_path, 2)
    config = cluster_config(tiny_models(family), hostfile, cluster={"sharding": sharding})
    c = Cluster(tmp_path, config).start(only=[0], wait_ready=False)
    try:
        code = c.wait_exit(0, 60)
        assert code == 2, c.logs()
        assert needle in c.rank0.log(), c.rank0.log()
    finally:
        c.stop()


def test_a_follower_without_rank_0_exits_non_zero(tmp_path, tiny_models):
    hostfile = write_hostfile(tmp_path, 2)
    config = cluster_config(tiny_models("llama"), hostfile, cluster={"join_timeout": 3.0})
    c = Cluster(tmp_path, config).start(only=[1], wait_ready=False)
    try:
        code = c.wait_exit(1, 60)
        assert code == -signal.SIGKILL, c.logs()
        assert "rank 0 at" in c.ranks[1].log()
    finally:
        for d in c.ranks:
            if d.proc is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGKILL)
        c.stop()
