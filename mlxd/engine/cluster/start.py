"""Rank 0's start in a cluster: refuse what cannot work, join, then load shards.

Runs on rank 0's engine thread (see :mod:`mlxd.engine.chat.engine`). The checks
come first, so a model the cluster cannot serve is refused before any rank
waits on another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxd.config import ModelSettings, Settings
from mlxd.engine.chat.loading import ModelLoadError, resolve_model_path
from mlxd.engine.cluster.join import (
    ClusterError,
    ModelAndConfig,
    check_shardable,
    join,
    make_loader,
)
from mlxd.engine.cluster.leader import Leader


def check_model(leader: Leader, model: ModelSettings, *, optimized_blas: bool) -> None:
    """Refuse a model the cluster cannot shard; fix the sharding it will use.

    Raises:
        ClusterError: with the reason (no shard/pipeline support, heads the
            rank count does not divide, no safetensors index, a bad path).
    """
    try:
        path, _ = resolve_model_path(model, optimized_blas=optimized_blas)
    except ModelLoadError as exc:
        raise ClusterError(str(exc)) from exc
    world = leader.collectives.size if leader.collectives else leader.member.world
    leader.sharding = check_shardable(path, leader.settings.sharding, world)


def start_leader(leader: Leader, settings: Settings, *, optimized_blas: bool) -> None:
    """Check the model, join the group (under ``join_timeout``), start the watchdog."""
    check_model(leader, settings.model, optimized_blas=optimized_blas)
    group = join(leader.member, leader.settings.join_timeout)
    leader.join(group, settings.batch, settings.prompt_cache)
    leader.watch()


def shard_loader(leader: Leader) -> Callable[[str, dict[str, Any]], ModelAndConfig]:
    """The loader of rank 0's shard (:func:`~.join.make_loader`), once joined."""
    assert leader.collectives is not None
    return make_loader(leader.collectives.group, leader.sharding)
