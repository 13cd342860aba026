"""The pure parts of a cluster: the plan's wire format, digests, membership, config."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from mlxd.config import ConfigError, load_settings
from mlxd.engine.cluster.join import ClusterError, http_port_clash, membership
from mlxd.engine.cluster.plan import (
    Collectives,
    Digest,
    Fetch,
    Insert,
    Load,
    Plan,
    Remove,
    RowSpec,
    Shutdown,
    Store,
    TokenChecksum,
    Trim,
    compare_digests,
    decode_plan,
    encode_plan,
    is_collective_error,
    tokens_crc,
)


def _spec(**kw) -> RowSpec:
    base = dict(
        id="r1", lane="batch", prompt=[1, 2, 3], max_tokens=8, temperature=0.7, top_p=0.9,
        top_k=5, min_p=0.0, seed=None, repetition_penalty=1.1, presence_penalty=None,
        frequency_penalty=0.5, logit_bias=[(7, -2.5)], logprobs=True, top_logprobs=2, fault=None,
    )  # fmt: skip
    base.update(kw)
    return RowSpec(**base)


def test_a_plan_round_trips_exactly():
    plan = Plan(
        seq=42,
        ops=[
            Fetch([1, 2, 3], 2),
            Insert(0, _spec()),
            Remove([0, 3], True),
            Store(5, tokens_crc([1, 2, 3, 4, 5])),
            Trim(4),
            Load({"path": "/m", "name": None}, 2, "tensor"),
            Shutdown(),
        ],
        run="batch",
        digest=True,
    )
    data = encode_plan(plan)
    assert b"pickle" not in data and decode_plan(data) == plan
    # An empty heartbeat is a handful of bytes.
    assert len(encode_plan(Plan(7, []))) < 16


def test_a_corrupt_plan_is_refused():
    import msgspec

    with pytest.raises(msgspec.DecodeError):
        decode_plan(b"\x94\x01\x91\xa3bad")


def test_digests_agree_or_say_which_rank_diverged():
    a, b = TokenChecksum(), TokenChecksum()
    for c in (a, b):
        c.add([5, 6, 7])
        c.step()
    rows = [Digest(3, a.steps, a.value, 100, 200), Digest(3, b.steps, b.value, 90, 180)]
    assert compare_digests(rows) is None  # memory may differ between ranks
    b.add([8])
    why = compare_digests([Digest(3, a.steps, a.value, 0, 0), Digest(3, b.steps, b.value, 0, 0)])
    assert why is not None and "rank 1 diverged" in why


def test_collective_errors_are_recognised():
    assert is_collective_error(RuntimeError("[ring] connection to a peer was lost"))
    assert not is_collective_error(ValueError("logits processor failed"))


@pytest.fixture(autouse=True)
def _cluster_environment() -> Iterator[None]:
    """membership() exports MLX_RANK and MLX_HOSTFILE for mx.distributed.init: put them back,
    or a later test's subprocess (mlx_lm.server in the benchmarks) joins this test's ring."""
    saved = {name: os.environ.get(name) for name in ("MLX_RANK", "MLX_HOSTFILE")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_membership_from_config_and_environment(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5000"]]))
    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    s = load_settings(None, overrides={"cluster": {"hostfile": str(hosts), "rank": 1}})
    m = membership(s.cluster)
    assert (m.rank, m.world, m.addresses) == (1, 2, ("10.0.0.1:5000", "10.0.0.2:5000"))
    monkeypatch.setenv("MLX_RANK", "0")
    m = membership(load_settings(None, overrides={"cluster": {"hostfile": str(hosts)}}).cluster)
    assert m.rank == 0


@pytest.mark.parametrize(
    ("cluster", "hostfile", "needle"),
    [
        ({}, None, "no rank is known"),
        ({"rank": 0}, None, "no hostfile is known"),
        ({"rank": 2}, [["a:1"], ["b:1"]], "outside the hostfile's 2 ranks"),
        ({"rank": 0}, {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["a"]}]}, "mlx.launch"),
    ],
)
def test_membership_refuses_with_a_reason(tmp_path, monkeypatch, cluster, hostfile, needle):
    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    if hostfile is not None:
        path = tmp_path / "hosts.json"
        path.write_text(json.dumps(hostfile))
        cluster = {**cluster, "hostfile": str(path)}
    with pytest.raises(ClusterError, match=needle):
        membership(load_settings(None, overrides={"cluster": cluster}).cluster)


def test_cluster_table_is_optional_and_checked(tmp_path):
    assert load_settings(None).cluster is None
    path = tmp_path / "mlxd.toml"
    path.write_text('[cluster]\nbackend = "ring"\nstep_timeout = 30\n')
    s = load_settings(path)
    assert s.cluster is not None and s.cluster.step_timeout == 30 and s.cluster.sharding == "auto"
    path.write_text('[cluster]\nbackend = "carrier-pigeon"\n')
    with pytest.raises(ConfigError, match=r"\[cluster\] backend"):
        load_settings(path)


def test_a_plan_that_loads_a_model_never_carries_a_digest():
    """Followers load (collectives of its own) before their digest; rank 0 would not."""
    from mlxd.config import ClusterSettings
    from mlxd.engine.cluster.join import Membership
    from mlxd.engine.cluster.leader import DIGEST_EVERY, Leader

    class Recorder:  # stands in for the group: keeps what rank 0 would broadcast
        rank, size = 0, 2
        sent: list[bytes] = []

        def broadcast(self, data: bytes) -> bytes:
            self.sent.append(data)
            return data

    leader = Leader(ClusterSettings(), Membership(0, 2, "ring", None, ("a:1", "b:1")))
    leader.collectives = Recorder()  # type: ignore[assignment]
    leader.state = "ready"
    leader.seq = DIGEST_EVERY - 1
    leader.load({"path": "/m"}, 1)
    plan = decode_plan(Recorder.sent[-1])
    assert plan.seq % DIGEST_EVERY == 0 and isinstance(plan.ops[-1], Load)
    assert plan.digest is False


@pytest.mark.parametrize(
    ("hosts", "http", "clash"),
    [
        ([["127.0.0.1:7001"], ["127.0.0.1:8000"]], ("127.0.0.1", 8000), "rank 1"),
        ([["10.0.0.1:8000"], ["10.0.0.2:7001"]], ("0.0.0.0", 8000), "rank 0"),
        ([["10.0.0.1:7001"], ["10.0.0.2:8000"]], ("10.0.0.2", 8000), "rank 1"),
        # Another machine may use the number rank 0 serves HTTP on.
        ([["10.0.0.1:7001"], ["10.0.0.2:8000"]], ("10.0.0.1", 8000), None),
        ([["127.0.0.1:7001"], ["127.0.0.1:7002"]], ("127.0.0.1", 8000), None),
    ],
)
def test_a_ring_address_on_rank_0s_http_port_is_refused(tmp_path, monkeypatch, hosts, http, clash):
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts))
    member = membership(
        load_settings(None, overrides={"cluster": {"hostfile": str(path), "rank": 0}}).cluster
    )
    found = http_port_clash(member, *http)
    if clash is None:
        assert found is None
    else:
        assert found is not None and clash in found and "different ports" in found, found


def test_host_names_that_arrive_as_garbage_are_a_cluster_error():
    """A ring connected to an HTTP server once gathered values past 255: a ValueError that
    killed rank 0's engine thread, leaving it at 503 for good."""

    class Garbled(Collectives):
        def __init__(self, rows):
            self.rows = rows

        def gather(self, values):
            return self.rows(values)

    names = Garbled(lambda v: [v, v]).gather_text("host-a")
    assert names == ["host-a", "host-a"]
    with pytest.raises(ClusterError, match="HTTP port"):
        Garbled(lambda v: [v, [v[0] + 300, *v[1:]]]).gather_text("host-a")
