"""Start a real mlxd cluster on this machine: N ``ring`` ranks on 127.0.0.1.

Each rank is the real ``python -m mlxd serve`` with the same config file and
its own ``MLX_RANK``, as one service unit per host would run it (no
launcher). Rank 0 serves HTTP; the others serve nothing.

The ``clusters`` fixture (module scope) is the factory for a module's cluster:
``clusters(model, world=2, **sections)`` starts one and stops it when the module
ends. Tests that kill or never fully start ranks build a :class:`Cluster` directly.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon, free_port, toml_config

__all__ = ["Cluster", "cluster_config", "clusters", "write_hostfile"]


def write_hostfile(workdir: Path, world: int) -> Path:
    path = Path(workdir) / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(world)]))
    return path


def cluster_config(model: Path, hostfile: Path, **sections: dict[str, Any]) -> str:
    cluster = {"hostfile": str(hostfile), "backend": "ring", "join_timeout": 60.0}
    cluster.update(sections.pop("cluster", {}))
    return toml_config(
        model={"path": str(model)},
        runtime={"blas": "off"},
        cluster=cluster,
        **sections,
    )


class Cluster:
    """Rank 0 (a :class:`Daemon` with HTTP) and the follower ranks."""

    def __init__(self, workdir: Path, config: str, world: int = 2, *, env: dict | None = None):
        self.workdir = Path(workdir)
        self.ranks = [
            Daemon(
                self.workdir / f"rank{r}",
                config,
                env={"MLX_RANK": str(r), **(env or {})},
                name=f"rank{r}",
            )
            for r in range(world)
        ]

    @property
    def rank0(self) -> Daemon:
        return self.ranks[0]

    def start(self, *, only: list[int] | None = None, wait_ready: bool = True) -> Cluster:
        for r, daemon in enumerate(self.ranks):
            if only is None or r in only:
                daemon.start(wait_ready=False)
        if wait_ready:
            try:
                self.rank0.wait_ready(180)
            except BaseException:
                self.stop()
                raise
        return self

    def wait_exit(self, rank: int, timeout: float) -> int | None:
        proc = self.ranks[rank].proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        return proc.poll()

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}\n{d.log()[-4000:]}" for r, d in enumerate(self.ranks))

    def stop(self) -> list[int | None]:
        """SIGTERM rank 0 (it shuts the group down), then make sure every rank is gone."""
        codes = [self.rank0.stop(timeout=60)]
        for daemon in self.ranks[1:]:
            if daemon.proc is not None and daemon.proc.poll() is None:
                try:
                    daemon.proc.wait(20)
                except Exception:
                    daemon.proc.send_signal(signal.SIGKILL)
            codes.append(daemon.stop(timeout=10))
        return codes


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Cluster]]:
    """``clusters(model, world=2, **sections)``: a started cluster, stopped with the module."""
    started: list[Cluster] = []

    def start(model: Path, world: int = 2, **sections: dict[str, Any]) -> Cluster:
        work = tmp_path_factory.mktemp("cluster")
        config = cluster_config(model, write_hostfile(work, world), **sections)
        cluster = Cluster(work, config, world).start()
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()  # a no-op for one a test already stopped
