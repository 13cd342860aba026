"""The ``cluster`` section of /stats as frozen values: what rank 0 publishes in its snapshot.

No MLX here: the values cross from the engine thread to the HTTP side
(``Snapshot.cluster``) and render as the JSON documented in docs/cluster.md
("Stats: the cluster section") through ``Snapshot.as_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ClusterState = Literal["forming", "ready", "peer_lost"]


@dataclass(frozen=True)
class RankStatus:
    """One rank as rank 0 last saw it."""

    rank: int
    host: str | None
    address: str | None
    active_memory_bytes: int
    peak_memory_bytes: int
    # Seconds since rank 0 last completed a collective with every rank; None before joining.
    last_heartbeat_age_s: float | None


@dataclass(frozen=True)
class ClusterEvent:
    """Something that happened to the group (``joined``, ``peer_lost``)."""

    at: float
    kind: str
    message: str


@dataclass(frozen=True)
class ClusterStatus:
    """The group, as rank 0 sees it (field meanings in docs/cluster.md)."""

    backend: str
    world_size: int
    rank: int
    sharding: str
    state: ClusterState
    error: str | None
    ranks: tuple[RankStatus, ...]
    plans: int
    steps: int
    plan_bytes: int
    comm_seconds: float
    comm_ms_per_step: float
    join_timeout: float
    step_timeout: float
    # Newest first.
    events: tuple[ClusterEvent, ...]
