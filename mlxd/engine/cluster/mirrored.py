"""Rank 0's batch lane, serial run and prompt cache: the engine's own, recording each MLX operation.

Each class is the chat engine's class with every MLX-side change (a row
inserted or removed, a reset, a prompt-cache lookup, store or eviction, a
setting) recorded into the leader's next plan, and every model step
preceded by that plan's broadcast (:meth:`Leader.sync`). The followers
apply the same operations to the same classes (:mod:`.replica`), so every
rank's caches hold the same rows in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Protocol

from mlxd.config import BatchSettings, PromptCacheSettings, SpeculativeSettings
from mlxd.engine.chat.batch import BatchLane, TokenOut
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.prompt_cache import Entry, Fetched, Kind, PromptCache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.serial import SerialRun, SerialStep
from mlxd.engine.cluster.plan import (
    EndSerial,
    Fetch,
    Insert,
    Op,
    PeerLost,
    Remove,
    ResetBatch,
    Run,
    StartSerial,
    Store,
    Trim,
    is_collective_error,
    tokens_crc,
)
from mlxd.engine.cluster.rows import row_spec


class PlanRecorder(Protocol):
    """What the mirrored parts need of rank 0's :class:`~.leader.Leader`."""

    def record(self, op: Op) -> None:
        """Add ``op`` to the next plan."""
        ...

    def configure(self, batch: BatchSettings, cache: PromptCacheSettings) -> None:
        """Record the live batch and prompt-cache settings."""
        ...

    def sync(self, run: Run) -> None:
        """Broadcast the plan, with the step about to run."""
        ...

    def after_step(self, tokens: list[int] | None) -> None:
        """The planned step ran here and sampled ``tokens``."""
        ...

    def lost(self, message: str) -> PeerLost:
        """Mark the cluster lost; the exception to raise."""
        ...


class MirroredBatchLane(BatchLane):
    """The batch lane on rank 0: every change is recorded, every step is planned."""

    def __init__(
        self, loaded: LoadedModel, settings: BatchSettings, *, faults: bool, leader: PlanRecorder
    ):
        super().__init__(loaded, settings, faults=faults, paced=False)
        self._leader = leader

    def speculate(self, settings: SpeculativeSettings) -> None:
        """A cluster does not speculate: its ranks step in lockstep on plain steps."""
        return None

    def insert(self, row: Row, cache: list[Any] | None, rest: list[int]) -> None:
        super().insert(row, cache, rest)
        self._leader.record(Insert(int(row.uid or 0), row_spec(row)))

    def remove(self, rows: list[Row], *, return_caches: bool = False) -> dict[int, Any]:
        uids = [int(r.uid) for r in rows if r.uid is not None and r.uid in self.rows]
        if uids:
            self._leader.record(Remove(uids, return_caches))
        return super().remove(rows, return_caches=return_caches)

    def reset(self, settings: BatchSettings) -> list[Row]:
        self._leader.record(ResetBatch())
        return super().reset(settings)

    def step(self) -> list[TokenOut]:
        leader = self._leader
        leader.sync("batch")
        try:
            outs = super().step()
        except Exception as exc:
            if is_collective_error(exc):
                raise leader.lost(f"the batched step lost a peer: {exc}") from exc
            leader.after_step([])
            raise
        leader.after_step([o.token for o in outs])
        return outs


class MirroredSerialRun(SerialRun):
    """The serial lane on rank 0: started, stepped and ended in step with every rank."""

    def __init__(
        self,
        loaded: LoadedModel,
        row: Row,
        cache: list[Any] | None,
        rest: list[int],
        *,
        leader: PlanRecorder,
        prefill_step_size: int,
        pump: Callable[[], None],
        faults: bool = False,
    ):
        self._leader = leader
        self._ended = False
        leader.record(StartSerial(row_spec(row)))
        super().__init__(
            loaded, row, cache, rest, prefill_step_size=prefill_step_size, pump=pump, faults=faults
        )

    def _progress(self, done: int, total: int) -> None:
        # A cancel cannot stop a prefill midway: every rank must run the same chunks.
        self.row.prefill_done = done
        if done < total:
            self._pump()

    def step(self, eos_ids: Collection[int]) -> SerialStep:
        leader = self._leader
        runs = not self.row.cancelled
        before = self.row.generated
        if runs:
            leader.sync("serial")
        out = super().step(eos_ids)
        if runs:
            if out.engine_error and out.error and is_collective_error(out.error):
                raise leader.lost(f"the serial step lost a peer: {out.error}")
            new = self.row.generated_ids[before:] if self.row.generated > before else []
            leader.after_step(list(new))
        return out

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self._leader.record(EndSerial())
        super().close()


class MirroredPromptCache(PromptCache):
    """The prompt cache on rank 0: lookups, stores and evictions are recorded."""

    def __init__(
        self,
        settings: PromptCacheSettings,
        *,
        leader: PlanRecorder,
        batch: Callable[[], BatchSettings],
    ):
        super().__init__(settings)
        self._leader = leader
        self._batch = batch

    def configure(self, settings: PromptCacheSettings, live_bytes: int) -> None:
        self._leader.configure(self._batch(), settings)
        super().configure(settings, live_bytes)
        self._trimmed()

    def fetch(self, prompt: list[int]) -> Fetched:
        fetched = super().fetch(prompt)
        self._leader.record(Fetch(list(prompt), len(prompt) - len(fetched.rest)))
        return fetched

    def _keep(
        self, tokens: list[int], cache: list[Any], kind: Kind, *, on_disk: bool = False
    ) -> Entry | None:
        entry = super()._keep(tokens, cache, kind, on_disk=on_disk)
        if entry is not None:
            self._leader.record(Store(len(tokens), tokens_crc(list(tokens))))
        return entry

    def store(
        self,
        tokens: list[int] | None,
        cache: list[Any] | None,
        live_bytes: int,
        kind: Kind = "assistant",
    ) -> bool:
        kept = super().store(tokens, cache, live_bytes, kind)
        self._trimmed()
        return kept

    def trim(self, live_bytes: int) -> None:
        before = len(self)
        super().trim(live_bytes)
        if len(self) != before:
            self._trimmed()

    def clear(self) -> None:
        super().clear()
        self._leader.record(Trim(0))

    def _trimmed(self) -> None:
        self._leader.record(Trim(len(self)))
