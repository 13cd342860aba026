"""One model tensor-sharded over two local ``ring`` ranks: same tokens as one machine.

A real two-rank cluster (two ``mlxd serve`` processes on 127.0.0.1, tiny
llama, tensor sharding) answers over HTTP; every output is compared token
for token (as text) with the same requests run by a one-process engine on
the same model. The module ends with SIGTERM on rank 0: both ranks exit 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import pytest

from tests.support import ROOT
from tests.support.cluster import Cluster
from tests.support.engine import run_all, running_engine, token_request
from tests.support.stats_schema import check_schema

PROMPTS = [
    [5, 17, 42, 99, 7],
    [120, 3, 3, 64, 88, 19, 250, 31, 2, 77, 140],
    [9, 180],
    [33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199, 210, 221],
]
SHORT, LONG = 12, 200


@pytest.fixture(scope="module")
def models(tiny_models):
    return {"a": tiny_models("llama"), "b": tiny_models("llama", seed=1)}


@pytest.fixture(scope="module")
def reference(models):
    """What one process answers, per model and max_tokens: {(model, n): [text, ...]}."""
    out = {}
    for key in ("a", "b"):
        with running_engine(models[key]) as engine:
            for n in (SHORT, LONG) if key == "a" else (SHORT,):
                reqs = [token_request(f"{key}{n}-{i}", p, n) for i, p in enumerate(PROMPTS)]
                outcomes = run_all(engine, reqs)
                assert all(o.ok for o in outcomes)
                out[(key, n)] = [o.text for o in outcomes]
    return out


@pytest.fixture(scope="module")
def cluster(clusters, models):
    return clusters(models["a"], batch={"size": 4})


def complete(c: Cluster, prompt: list[int], n: int, **extra) -> httpx.Response:
    with c.rank0.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, **extra}
        return http.post("/v1/completions", json=body)


def texts(c: Cluster, n: int, **extra) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: complete(c, p, n, **extra), PROMPTS))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["text"] for r in responses]


def test_two_ranks_form_one_cluster(cluster):
    section = cluster.rank0.stats()["cluster"]
    assert section["world_size"] == 2 and section["sharding"] == "tensor"
    assert section["state"] == "ready" and section["backend"] == "ring"
    assert [r["rank"] for r in section["ranks"]] == [0, 1]
    assert all(r["host"] for r in section["ranks"])
    assert "loaded its tensor shard" in cluster.ranks[1].log()


def test_serial_lane_matches_one_rank(cluster, reference):
    for i, prompt in enumerate(PROMPTS):
        r = complete(cluster, prompt, SHORT, seed=7)
        assert r.status_code == 200, r.text
        assert r.headers["x-mlxd-lane"].startswith("serial")
        assert r.json()["choices"][0]["text"] == reference[("a", SHORT)][i]


def test_concurrent_batch_matches_one_rank(cluster, reference):
    before = cluster.rank0.stats()["cluster"]["steps"]
    assert texts(cluster, SHORT) == reference[("a", SHORT)]
    stats = cluster.rank0.stats()
    assert stats["cluster"]["steps"] > before
    assert stats["counters"]["requests"]["batch"]["completed"] >= len(PROMPTS)
    # The prompt cache hit on these repeated prompts on both ranks alike.
    assert texts(cluster, SHORT) == reference[("a", SHORT)]
    assert cluster.rank0.stats()["cluster"]["state"] == "ready"


def test_sampling_stays_in_step_on_every_rank(cluster):
    """Unseeded sampling draws from MLX's generator on every rank: seeded alike at join."""
    before = cluster.rank0.stats()["cluster"]["plans"]
    out = texts(cluster, 24, temperature=1.0, top_p=0.95)
    assert len(set(out)) > 1
    after = cluster.rank0.stats()["cluster"]
    # Digests (every 8 plans) compared the sampled tokens of both ranks.
    assert after["plans"] - before >= 16 and after["state"] == "ready"
    assert cluster.ranks[1].proc.poll() is None


def test_structured_output_masks_the_same_tokens_on_every_rank(cluster):
    """A grammar row beside free rows: every rank applies the same mask, so they stay in step."""
    before = cluster.rank0.stats()["cluster"]["plans"]
    fmt = {"type": "json_object"}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        constrained = pool.submit(complete, cluster, PROMPTS[0], 40, response_format=fmt)
        free = [pool.submit(complete, cluster, p, 40) for p in PROMPTS[1:3]]
        r = constrained.result()
        assert all(f.result().status_code == 200 for f in free)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["text"])
    else:  # cut by max_tokens: still a prefix the grammar allowed
        assert choice["text"].lstrip().startswith(("{", "["))
    after = cluster.rank0.stats()["cluster"]
    assert after["plans"] - before >= 16 and after["state"] == "ready"


def test_disconnect_mid_stream_keeps_ranks_in_step(cluster, reference):
    with cluster.rank0.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                if chunks >= 3:
                    break
    stats = cluster.rank0.wait_idle()
    assert stats["counters"]["requests"]["batch"]["cancelled"] >= 1
    # The row left on every rank: the next batch is still exact, and digests agree.
    assert texts(cluster, SHORT) == reference[("a", SHORT)]
    assert cluster.rank0.stats()["cluster"]["state"] == "ready"
    assert cluster.ranks[1].proc.poll() is None


def test_seeded_request_drains_the_batch(cluster, reference):
    drains_before = cluster.rank0.stats()["counters"]["drains"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        batch = [pool.submit(complete, cluster, p, LONG) for p in PROMPTS[:2]]
        cluster.rank0.wait_rows(2)  # the seeded request must find the batch running
        seeded = pool.submit(complete, cluster, PROMPTS[2], SHORT, seed=3)
        results = [f.result() for f in batch]
        serial = seeded.result()
    assert serial.status_code == 200 and serial.headers["x-mlxd-lane"].startswith("serial")
    assert serial.json()["choices"][0]["text"] == reference[("a", SHORT)][2]
    assert [r.json()["choices"][0]["text"] for r in results] == reference[("a", LONG)][:2]
    assert cluster.rank0.stats()["counters"]["drains"] > drains_before


def test_reload_swaps_the_model_on_every_rank(cluster, models, reference):
    config = cluster.rank0.config_path.read_text()
    cluster.rank0.write_config(config.replace(str(models["a"]), str(models["b"])))
    r = cluster.rank0.reload()
    assert r.status_code == 200, r.text
    assert r.json()["outcome"] == "applied", r.json()
    assert cluster.rank0.model_id() == models["b"].name
    assert texts(cluster, SHORT) == reference[("b", SHORT)]
    assert cluster.ranks[1].log().count("loaded its tensor shard") == 2


def test_a_swap_to_a_model_the_cluster_cannot_shard_keeps_the_old_one(
    cluster, models, reference, tiny_models
):
    serving = cluster.rank0.model_id()
    config = cluster.rank0.config_path.read_text()
    cluster.rank0.write_config(config.replace(str(models["b"]), str(tiny_models("llama_b"))))
    body = cluster.rank0.reload().json()
    assert "num_key_value_heads (3) to be a multiple of 2" in json.dumps(body), body
    assert cluster.rank0.model_id() == serving
    assert texts(cluster, SHORT) == reference[("b", SHORT)]
    cluster.rank0.write_config(config)
    assert cluster.rank0.stats()["cluster"]["state"] == "ready"


def test_cluster_keys_need_a_restart(cluster):
    config = cluster.rank0.config_path.read_text()
    cluster.rank0.write_config(config.replace("join_timeout = 60.0", "join_timeout = 61.0"))
    body = cluster.rank0.reload().json()
    assert body["outcome"] == "restart_required", json.dumps(body)
    assert "cluster.join_timeout" in json.dumps(body)
    assert cluster.rank0.stats()["cluster"]["join_timeout"] == 60.0


def test_stats_cluster_section_is_documented_in_cluster_md(cluster):
    doc = (ROOT / "docs" / "cluster.md").read_text()
    fields = {
        m.group(1): m.group(2).replace("\\|", "|")
        for m in re.finditer(r"^\| `(cluster[^`]*)` \| `([^`]+)` \|", doc, re.M)
    }
    assert len(fields) > 15
    seen: set[str] = set()
    check_schema(
        {"cluster": cluster.rank0.stats()["cluster"]}, {"cluster": "object", **fields}, seen
    )
    assert set(fields) - seen == set(), "documented in cluster.md but not in /stats"


def test_metrics_and_dashboard_show_every_rank(cluster):
    with cluster.rank0.client() as http:
        metrics = http.get("/metrics").text
        page = http.get("/dashboard").text
        panel = http.get("/dashboard/cluster").text
    assert "mlxd_cluster_ready 1.0" in metrics
    memory = [m for m in metrics.splitlines() if m.startswith("mlxd_cluster_rank_active_memory")]
    assert sorted(re.search(r'rank="(\d+)"', m).group(1) for m in memory) == ["0", "1"]
    assert 'id="cluster"' in page and 'data-rank="1"' in page
    assert 'data-field="cluster-state">in step<' in panel


def test_sigterm_on_rank_0_stops_every_rank_with_0(cluster):
    codes = cluster.stop()
    assert codes == [0, 0], cluster.logs()
    assert "rank 0 shut the cluster down" in cluster.ranks[1].log()
