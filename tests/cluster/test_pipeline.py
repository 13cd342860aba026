"""Pipeline sharding over two local ``ring`` ranks: the same tokens as one machine.

The tiny qwen3_5 (gated-delta and attention layers) supports mlx-lm's
``pipeline``; its directory is copied with a ``model.safetensors.index.json``
(which ``sharded_load`` needs to pick each stage's files). Rank 0 runs the
last layers, rank 1 the first.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil

import mlx.core as mx
import pytest

from tests.support.cluster import Cluster
from tests.support.engine import run_all, running_engine, token_request

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 64, 88, 19, 250, 31], [9, 180, 4]]
N = 10


@pytest.fixture(scope="module")
def indexed_model(tmp_path_factory, tiny_models):
    src = tiny_models("qwen3_5")
    dst = tmp_path_factory.mktemp("pipeline") / "qwen3_5-indexed"
    shutil.copytree(src, dst)
    names = sorted(mx.load(str(dst / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module")
def reference(indexed_model):
    with running_engine(indexed_model) as engine:
        outcomes = run_all(engine, [token_request(f"p{i}", p, N) for i, p in enumerate(PROMPTS)])
    assert all(o.ok for o in outcomes)
    return [o.text for o in outcomes]


@pytest.fixture(scope="module")
def cluster(clusters, indexed_model):
    return clusters(indexed_model, cluster={"sharding": "pipeline"})


def _complete(c: Cluster, prompt: list[int], **extra) -> str:
    with c.rank0.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, **extra}
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_pipeline_batch_and_serial_match_one_rank(cluster, reference):
    assert cluster.rank0.stats()["cluster"]["sharding"] == "pipeline"
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: _complete(cluster, p), PROMPTS))
    assert batched == reference
    assert [_complete(cluster, p, seed=1) for p in PROMPTS] == reference
    assert "loaded its pipeline shard" in cluster.ranks[1].log()
    assert cluster.stop() == [0, 0], cluster.logs()
