"""Joining the cluster and loading this rank's shard of the model.

``[cluster]`` keys fill in ``MLX_RANK`` and ``MLX_HOSTFILE`` when they are
set (one service unit per host, no launcher); under ``mlx.launch`` the
launcher's environment is used as is. ``mx.distributed.init`` has no
timeout, so :func:`join` runs it under a deadline and names the ranks that
did not show up. :func:`check_shardable` refuses, before anything loads,
what cannot work.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from mlxd.config import ClusterSettings

logger = logging.getLogger(__name__)

# What mlx-lm's loaders return with return_config=True: model, tokenizer, config.
ModelAndConfig: TypeAlias = tuple[Any, Any, dict[str, Any]]


class ClusterError(Exception):
    """The cluster cannot start; the message says why and what to do."""


@dataclass(frozen=True)
class Membership:
    """Who this process is in the cluster, before ``init``."""

    rank: int
    world: int
    backend: str
    hostfile: str | None
    addresses: tuple[str, ...]  # one line per rank, for messages
    # Every rank's hostfile addresses ("ip:port"), by rank: how links.Links finds the ring.
    endpoints: tuple[tuple[str, ...], ...] = ()


def _read_hostfile(path: str) -> list[Any]:
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise ClusterError(f"cannot read the cluster hostfile {path!r}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ClusterError(f"the cluster hostfile {path!r} is not JSON: {exc}") from exc
    if isinstance(data, dict) and isinstance(data.get("hosts"), list):
        raise ClusterError(
            f"{path!r} is an mlx.launch hostfile (with 'hosts'); [cluster] hostfile takes the "
            'per-rank list MLX reads, e.g. [["10.0.0.1:5000"], ["10.0.0.2:5000"]] '
            "(docs/cluster.md), or run under mlx.launch and leave it unset"
        )
    if not isinstance(data, list) or not data:
        raise ClusterError(f"the cluster hostfile {path!r} must be a non-empty JSON list")
    return data


def membership(settings: ClusterSettings) -> Membership:
    """This rank and the world size, from ``[cluster]`` and the environment.

    Sets ``MLX_RANK`` and ``MLX_HOSTFILE`` for MLX when the config gives them.

    Raises:
        ClusterError: no rank or hostfile anywhere, or a rank outside the hostfile.
    """
    rank = settings.rank
    if rank is None:
        env = os.environ.get("MLX_RANK")
        if env is None or not env.strip().isdigit():
            raise ClusterError(
                "[cluster] is set but no rank is known: set [cluster] rank or MLX_RANK "
                "(mlx.launch sets it)"
            )
        rank = int(env)
    hostfile = settings.hostfile or os.environ.get("MLX_HOSTFILE")
    addresses: tuple[str, ...] = ()
    endpoints: tuple[tuple[str, ...], ...] = ()
    world = 0
    if hostfile:
        # mlx.launch passes the list inline or as a path.
        text = hostfile.strip()
        entries = json.loads(text) if text.startswith("[") else _read_hostfile(hostfile)
        world = len(entries)
        endpoints = tuple(tuple(map(str, e)) if isinstance(e, list) else (str(e),) for e in entries)
        addresses = tuple(", ".join(e) for e in endpoints)
    elif settings.backend != "jaccl" and not os.environ.get("MLX_IBV_DEVICES"):
        raise ClusterError(
            "[cluster] is set but no hostfile is known: set [cluster] hostfile or MLX_HOSTFILE "
            "(mlx.launch sets it)"
        )
    if world and rank >= world:
        raise ClusterError(f"rank {rank} is outside the hostfile's {world} ranks")
    os.environ["MLX_RANK"] = str(rank)
    if settings.hostfile:
        os.environ["MLX_HOSTFILE"] = str(Path(settings.hostfile).expanduser())
    return Membership(rank, world, settings.backend, hostfile, addresses, endpoints)


# Hosts that always mean this machine, in a hostfile address.
_THIS_MACHINE = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})


def http_port_clash(member: Membership, host: str, port: int) -> str | None:
    """Why a hostfile address is rank 0's own HTTP address; None when none is.

    The ring would connect to the HTTP server, whose bytes no rank understands.
    """
    for rank, addresses in enumerate(member.endpoints):
        for address in addresses:
            ring_host, _, ring_port = address.rpartition(":")
            ring_host = ring_host.strip("[]")
            here = rank == member.rank or ring_host in _THIS_MACHINE or ring_host == host
            if ring_port == str(port) and here:
                return (
                    f"the hostfile gives rank {rank} the address {address}, which is the port "
                    f"rank 0 serves HTTP on: give the ring and HTTP different ports"
                )
    return None


def check_shardable(path: Path, sharding: str, world: int) -> str:
    """The sharding to use for the model at ``path`` over ``world`` ranks.

    Builds the model lazily (no weights are read) to see what it supports.

    Raises:
        ClusterError: the model supports neither tensor nor pipeline
            sharding, the rank count does not divide its heads (tensor), or
            it has no safetensors index (pipeline).
    """
    from mlx_lm.utils import _get_classes

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ClusterError(f"cannot read {path / 'config.json'}: {exc}") from exc
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    tensor = hasattr(model, "shard")
    pipeline = hasattr(getattr(model, "model", None), "pipeline")
    family = config.get("model_type", "?")
    if not tensor and not pipeline:
        raise ClusterError(
            f"the model at {str(path)!r} ({family}) supports neither tensor sharding (shard) "
            "nor pipeline sharding (pipeline) in mlx-lm: it cannot be served by a cluster"
        )
    if sharding == "auto":
        sharding = "tensor" if tensor else "pipeline"
    if sharding == "tensor":
        if not tensor:
            raise ClusterError(
                f"the model ({family}) has no tensor sharding in mlx-lm; "
                'set [cluster] sharding = "pipeline" or "auto"'
            )
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = config.get(key) or config.get("text_config", {}).get(key)
            if heads and world and heads % world:
                raise ClusterError(
                    f"tensor sharding over {world} ranks needs {key} ({heads}) to be a "
                    f"multiple of {world}: use a rank count that divides it, or pipeline sharding"
                )
    else:
        if not pipeline:
            raise ClusterError(
                f"the model ({family}) has no pipeline sharding in mlx-lm; "
                'set [cluster] sharding = "tensor" or "auto"'
            )
        if not (path / "model.safetensors.index.json").is_file():
            raise ClusterError(
                f"pipeline sharding needs {path / 'model.safetensors.index.json'} (which layers "
                "live in which file); convert the model with mlx_lm.convert, which writes it"
            )
    return sharding


# The deadman: ``mx.distributed.init`` holds the GIL while it waits, so no
# Python thread (nor signal handler) of this process can act on a deadline.
# A tiny child process does: it writes the message to our stderr and ends
# us with SIGKILL, unless we kill it first (we joined) or we are gone.
_DEADMAN = """
import os, signal, sys, time
parent, deadline, line = int(sys.argv[1]), time.monotonic() + float(sys.argv[2]), sys.argv[3]
while time.monotonic() < deadline:
    if os.getppid() != parent:
        sys.exit(0)
    time.sleep(0.1)
sys.stderr.write(line + "\\n")
sys.stderr.flush()
os.kill(parent, signal.SIGKILL)
"""


def _start_deadman(timeout: float, message: str) -> subprocess.Popen:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    line = f"{stamp} ERROR   mlxd.engine.cluster.join: {message}; exiting"
    return subprocess.Popen(
        [sys.executable, "-c", _DEADMAN, str(os.getpid()), str(timeout), line],
        stdin=subprocess.DEVNULL,
    )


def join(member: Membership, timeout: float) -> Any:
    """``mx.distributed.init`` under a deadline; returns the group.

    When the ranks have not all joined after ``timeout`` seconds, the
    process is ended (SIGKILL, from a watcher process: ``init`` cannot be
    interrupted) after logging which ranks it waited for.
    """
    import mlx.core as mx

    others = [r for r in range(member.world) if r != member.rank] if member.world else []
    where = "; ".join(
        f"rank {r} at {member.addresses[r]}" for r in others if r < len(member.addresses)
    )
    message = (
        f"the cluster did not form within join_timeout ({timeout:g}s): rank {member.rank} of "
        f"{member.world or '?'} is waiting for {where or 'its peers'}, which has not joined. "
        "Start mlxd on every host with the same hostfile (docs/cluster.md)"
    )
    logger.info(
        "joining the cluster as rank %d of %s (waiting up to %gs for %s)",
        member.rank,
        member.world or "?",
        timeout,
        where or "the other ranks",
    )
    deadman = _start_deadman(timeout, message)
    try:
        backend = "any" if member.backend == "auto" else member.backend
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise ClusterError(f"mx.distributed.init failed ({member.backend}): {exc}") from exc
    finally:
        deadman.kill()
        deadman.wait()
    if member.world and group.size() != member.world:
        raise ClusterError(
            f"MLX formed a group of {group.size()} ranks but the hostfile lists {member.world}"
        )
    return group


def make_loader(group: Any, sharding: str) -> Callable[[str, dict[str, Any]], ModelAndConfig]:
    """A loader for :func:`mlxd.engine.chat.loading.load_model` that loads this rank's shard."""
    from mlx_lm.utils import sharded_load

    pipeline = sharding == "pipeline"

    def load(path: str, tokenizer_config: dict[str, Any]) -> ModelAndConfig:
        # sharded_load's default tokenizer config trusts remote code; mlxd's never does.
        loaded = sharded_load(
            path,
            pipeline_group=group if pipeline else None,
            tensor_group=None if pipeline else group,
            return_config=True,
            tokenizer_config={"trust_remote_code": False, **tokenizer_config},
        )
        if len(loaded) != 3:  # pragma: no cover - return_config=True always adds the config
            raise ClusterError(f"sharded_load({path!r}) returned no model config")
        return loaded

    return load
