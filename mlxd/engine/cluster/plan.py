"""The step plan rank 0 broadcasts, and the collectives that carry it.

In a cluster (``[cluster]`` in the config, docs/cluster.md) every rank runs
an engine thread that owns its shard of the model; rank 0 also decides
everything (intake, lanes, admission, drains, reload). Before each step that
runs the model, rank 0 broadcasts a :class:`Plan`: the MLX-side operations
it performed since the last plan (rows inserted with their token ids and
sampling parameters, rows removed, prompt-cache fetches and stores, lane and
setting changes, control messages) and which step to run. Every rank applies
the same operations in the same order, so the batch caches stay in lockstep.

Plans are msgspec Structs (never pickle), sent with MLX's own collectives:
an ``all_sum`` of the length, then an ``all_sum`` of the bytes (the other
ranks contribute zeros). Every few plans, the ranks ``all_gather`` a
:class:`Digest` (step count, a checksum of every sampled token, memory) and
stop on a mismatch. Nothing here is a transport of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from mlxd.engine.cluster.join import ClusterError
from mlxd.engine.messages import Lane

# ---------------------------------------------------------------- errors


class PeerLost(BaseException):
    """The cluster cannot go on: a collective failed, a rank diverged or timed out.

    A ``BaseException`` so that the engine's per-row ``except Exception``
    handlers, which contain a failing request, let it through: nothing on
    this rank can recover from it, the whole group must restart.
    """


_COLLECTIVE_MARKERS = ("[ring]", "[jaccl]", "[mpi]", "connection to a peer", "peer was lost")


def is_collective_error(exc: BaseException | str) -> bool:
    """True when ``exc`` (or its message) comes from a failed collective."""
    text = str(exc).lower()
    return any(marker in text for marker in _COLLECTIVE_MARKERS)


# ---------------------------------------------------------------- plan


class GrammarSpec(msgspec.Struct, frozen=True, array_like=True):
    """A row's grammar (:class:`mlxd.engine.messages.Constraint`) on the wire."""

    kind: Literal["json", "tools", "custom"]
    grammar: str
    key: str
    tool_format: str | None


class RowSpec(msgspec.Struct, frozen=True, array_like=True):
    """What every rank needs to run a row: tokens and sampling, no text."""

    id: str
    lane: Lane
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: list[tuple[int, float]]
    logprobs: bool
    top_logprobs: int
    fault: str | None
    # The row's grammar, and whether the row starts inside the model's think markers.
    constraint: GrammarSpec | None = None
    reasoning: bool = False
    # Prompt tokens it starts from out of the prompt cache: admission may keep less
    # of the hit than the lookup found (docs/batching.md, "Admission never wedges").
    cached: int = -1
    # The row's thinking budget (mlxd.engine.chat.reasoning_budget): every rank forces alike.
    reasoning_budget: int | None = None


class Fetch(msgspec.Struct, frozen=True, tag="fetch", array_like=True):
    """A prompt-cache lookup for the next row to start (``cached`` tokens hit)."""

    prompt: list[int]
    cached: int


class Insert(msgspec.Struct, frozen=True, tag="insert", array_like=True):
    """A row joins the batch with the last fetched prompt cache; ``uid`` checks order."""

    uid: int
    row: RowSpec


class Remove(msgspec.Struct, frozen=True, tag="remove", array_like=True):
    """Rows leave the batch early (stop string, cancel, failure)."""

    uids: list[int]
    caches: bool


class ResetBatch(msgspec.Struct, frozen=True, tag="reset", array_like=True):
    """Drop every batch row and start a fresh generator."""


class StartSerial(msgspec.Struct, frozen=True, tag="serial", array_like=True):
    """The serial lane starts a row with the last fetched prompt cache."""

    row: RowSpec


class EndSerial(msgspec.Struct, frozen=True, tag="end_serial", array_like=True):
    """The serial row ended (its generator is closed)."""


class Store(msgspec.Struct, frozen=True, tag="store", array_like=True):
    """A finished row's cache enters the prompt cache: ``n`` tokens with checksum ``crc``."""

    n: int
    crc: int


class Trim(msgspec.Struct, frozen=True, tag="trim", array_like=True):
    """The prompt cache keeps ``entries`` entries (the least recently used go)."""

    entries: int


class Configure(msgspec.Struct, frozen=True, tag="configure", array_like=True):
    """Live batch and prompt-cache settings (``model_dump`` of each section)."""

    batch: dict[str, Any]
    prompt_cache: dict[str, Any]


class Load(msgspec.Struct, frozen=True, tag="load", array_like=True):
    """Load (or swap to) this model; every rank loads its shard together."""

    model: dict[str, Any]
    generation: int
    sharding: str


class Seed(msgspec.Struct, frozen=True, tag="seed", array_like=True):
    """Seed MLX's global generator (once at start, so unseeded sampling agrees)."""

    value: int


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown", array_like=True):
    """Rank 0 is stopping: every rank exits 0 after this plan."""


Op = (
    Fetch
    | Insert
    | Remove
    | ResetBatch
    | StartSerial
    | EndSerial
    | Store
    | Trim
    | Configure
    | Load
    | Seed
    | Shutdown
)

Run = Literal["", "batch", "serial"]


class Plan(msgspec.Struct, frozen=True, array_like=True):
    """One step: apply ``ops`` in order, then run ``run`` ("" is a heartbeat)."""

    seq: int
    ops: list[Op]
    run: Run = ""
    digest: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Plan)


def encode_plan(plan: Plan) -> bytes:
    return _encoder.encode(plan)


def decode_plan(data: bytes) -> Plan:
    return _decoder.decode(data)


def tokens_crc(tokens: list[int]) -> int:
    """A checksum of a token sequence (identifies a released cache between ranks)."""
    import numpy as np

    return zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes())


# ---------------------------------------------------------------- collectives


class Collectives:
    """Broadcast and digest over one ``mx.distributed`` group (engine thread only).

    Every collective runs on mlx-lm's generation stream: the model's own
    collectives (inside a sharded forward, often still in flight after
    ``async_eval``) run there, and two streams would let the ranks pair
    one rank's plan with another's layer (seen as garbage plans).
    """

    def __init__(self, group: Any):
        from mlx_lm.generate import generation_stream

        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.stream = generation_stream

    def broadcast(self, data: bytes | None) -> bytes:
        """Rank 0 passes ``data``; every rank returns it."""
        import mlx.core as mx
        import numpy as np

        n = len(data) if self.rank == 0 and data is not None else 0
        total = mx.distributed.all_sum(
            mx.array([n], dtype=mx.int32), group=self.group, stream=self.stream
        )
        size = total.item()
        assert isinstance(size, int)  # an int32 sum
        if size == 0:
            return b""
        if self.rank == 0 and data is not None:
            buf = mx.array(np.frombuffer(data, dtype=np.uint8))
        else:
            buf = mx.zeros((size,), dtype=mx.uint8)
        out = mx.distributed.all_sum(buf, group=self.group, stream=self.stream)
        return bytes(np.array(out, copy=False))

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), by rank."""
        import mlx.core as mx
        import numpy as np

        mine = mx.array(values, dtype=mx.int64)
        out = mx.distributed.all_gather(mine, group=self.group, stream=self.stream)
        rows = np.asarray(out).reshape(self.size, len(values))
        return [[int(v) for v in row] for row in rows]

    def gather_digests(self, mine: Digest) -> list[Digest]:
        """Every rank's digest, by rank."""
        return [Digest.from_values(row) for row in self.gather(mine.values())]

    def gather_text(self, text: str, width: int = 64) -> list[str]:
        """Every rank's short ``text`` (host names), by rank."""
        raw = text.encode()[:width].ljust(width, b"\0")
        rows = self.gather(list(raw))
        if any(not 0 <= v < 256 for row in rows for v in row):
            raise ClusterError(
                "a rank's host name arrived as garbage: is every hostfile address an mlxd "
                "rank's, and none of them an HTTP port?"
            )
        return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]


class Digest(msgspec.Struct, frozen=True):
    """What each rank reports every few plans; plan, steps and checksum must agree."""

    seq: int
    steps: int
    checksum: int
    active_bytes: int
    peak_bytes: int

    @property
    def lockstep(self) -> tuple[int, int, int]:
        """What every rank in step has alike (memory may differ between shards)."""
        return (self.seq, self.steps, self.checksum)

    def values(self) -> list[int]:
        """The digest as it is gathered: integers in field order."""
        return [self.seq, self.steps, self.checksum, self.active_bytes, self.peak_bytes]

    @classmethod
    def from_values(cls, values: Sequence[int]) -> Digest:
        """The digest from :meth:`values` (as gathered from another rank)."""
        seq, steps, checksum, active_bytes, peak_bytes = values
        return cls(seq, steps, checksum, active_bytes, peak_bytes)


class TokenChecksum:
    """A running checksum of sampled tokens, the same on every rank in lockstep."""

    def __init__(self) -> None:
        self.steps = 0
        self.value = 0

    def add(self, tokens: list[int]) -> None:
        for t in tokens:
            self.value = (self.value * 1_000_003 + int(t) + 1) % 2_147_483_647

    def step(self) -> None:
        self.steps += 1


def local_digest(seq: int, checksum: TokenChecksum) -> Digest:
    import mlx.core as mx

    return Digest(
        seq=seq,
        steps=checksum.steps,
        checksum=checksum.value,
        active_bytes=int(mx.get_active_memory()),
        peak_bytes=int(mx.get_peak_memory()),
    )


def compare_digests(digests: Sequence[Digest]) -> str | None:
    """Why the ranks' digests (by rank) disagree, or None when they agree."""
    first = digests[0]
    for rank, digest in enumerate(digests[1:], start=1):
        if digest.lockstep != first.lockstep:
            return (
                f"rank {rank} diverged from rank 0: plan/steps/checksum "
                f"{list(digest.lockstep)} != {list(first.lockstep)}; "
                "the cluster stops rather than serve wrong tokens"
            )
    return None
