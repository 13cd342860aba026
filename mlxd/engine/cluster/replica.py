"""A follower's copy of rank 0's MLX state: lanes and prompt cache, changed only by plan operations.

The :class:`Replica` holds this rank's shard of the model, its batch lane,
its serial run and its prompt cache, the same classes rank 0's engine uses,
and applies each operation of a plan to them in order, then the planned
step. Anything that does not match what rank 0 recorded (a cache hit of
another length, a row uid, a store of a cache this rank never made) raises
:class:`~.rows.Desync`: the caches would drift, so the rank must leave.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from mlxd.config import BatchSettings, ModelSettings, PromptCacheSettings
from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.kv_caches import compact, cut_prefix
from mlxd.engine.chat.loading import LoadedModel, load_model, resolve_model_path
from mlxd.engine.chat.prompt_cache import PromptCache
from mlxd.engine.chat.serial import SerialRun
from mlxd.engine.cluster.join import check_shardable, make_loader
from mlxd.engine.cluster.plan import (
    Collectives,
    Configure,
    EndSerial,
    Fetch,
    Insert,
    Load,
    Op,
    Remove,
    ResetBatch,
    RowSpec,
    Seed,
    Shutdown,
    StartSerial,
    Store,
    TokenChecksum,
    Trim,
    is_collective_error,
    tokens_crc,
)
from mlxd.engine.cluster.rows import Desync, follower_row

logger = logging.getLogger(__name__)

# Prompt-cache lookups kept for rows that have not started yet.
_PREFETCHED_MAX = 8


class FollowerPromptCache(PromptCache):
    """A follower's prompt cache: rank 0 decides every store and eviction.

    Byte counts differ between shards (pipeline stages hold different
    layers), so this cache never evicts by bytes on its own; ``Trim``
    ops from rank 0 say how many entries to keep.
    """

    def configure(self, settings: PromptCacheSettings, live_bytes: int) -> None:
        self._settings = settings.model_copy(update={"max_bytes": 2**62})

    def insert(self, tokens: list[int], cache: Any) -> None:
        self._keep(tokens, cache, "assistant")


class Replica:
    """This rank's lanes and prompt cache, kept in lockstep with rank 0's (engine thread)."""

    def __init__(
        self,
        collectives: Collectives,
        batch: BatchSettings,
        *,
        optimized_blas: bool,
        faults: bool,
    ):
        self.col = collectives
        self.optimized_blas = optimized_blas
        self.faults = faults
        self.loaded: LoadedModel | None = None
        self.batch_settings = batch
        self.cache = FollowerPromptCache(PromptCacheSettings(max_entries=0))
        self.batch: BatchLane | None = None
        self.serial: SerialRun | None = None
        self.serial_tokens: list[int] = []
        # Prompt-cache lookups waiting for their row, newest last, by prompt.
        self.prefetched: OrderedDict[tuple[int, ...], list[tuple[Any, list[int]]]] = OrderedDict()
        # Caches rows released since the last plan, for Store: (n, crc) -> (tokens, cache).
        self.released: dict[tuple[int, int], tuple[list[int], Any]] = {}
        self.checksum = TokenChecksum()

    # ------------------------------------------------------------ ops

    def apply(self, op: Op) -> None:
        """Apply one operation of a plan to this rank's state."""
        if isinstance(op, Seed):
            import mlx.core as mx

            mx.random.seed(op.value)
        elif isinstance(op, Configure):
            self._configure(op)
        elif isinstance(op, Load):
            self.load(op)
        elif isinstance(op, Fetch):
            self._fetch(op)
        elif isinstance(op, Insert):
            self._insert(op)
        elif isinstance(op, Remove):
            self._remove(op)
        elif isinstance(op, ResetBatch):
            if self.batch is not None:
                self.batch.reset(self.batch_settings)
        elif isinstance(op, StartSerial):
            self._start_serial(op)
        elif isinstance(op, EndSerial):
            self._end_serial()
        elif isinstance(op, Store):
            self._store(op)
        elif isinstance(op, Trim):
            self.cache.keep(op.entries)
        elif isinstance(op, Shutdown):
            pass  # the follower stops after this plan
        else:  # pragma: no cover - a plan from a newer rank 0
            raise Desync(f"unknown operation {type(op).__name__}")

    def plan_done(self) -> None:
        """Caches released during a plan are stored by that plan or never."""
        self.released.clear()

    def _configure(self, op: Configure) -> None:
        self.batch_settings = BatchSettings(**op.batch)
        self.cache.configure(PromptCacheSettings(**op.prompt_cache), 0)
        if self.batch is not None:
            self.batch.configure(self.batch_settings)

    def _fetch(self, op: Fetch) -> None:
        self._model()
        fetched = self.cache.fetch(op.prompt)
        compact(fetched.cache)
        got = len(op.prompt) - len(fetched.rest)
        if got != op.cached:
            raise Desync(f"prompt cache hit {got} tokens here, {op.cached} on rank 0")
        self.prefetched.setdefault(tuple(op.prompt), []).append((fetched.cache, fetched.rest))
        while sum(len(v) for v in self.prefetched.values()) > _PREFETCHED_MAX:
            key = next(iter(self.prefetched))
            self.prefetched[key].pop(0)
            if not self.prefetched[key]:
                del self.prefetched[key]

    def _take_prefetched(self, spec: RowSpec) -> tuple[Any, list[int]]:
        """The lookup rank 0 made for this row, cut to the prefix rank 0 kept of it."""
        prompt = spec.prompt
        stack = self.prefetched.get(tuple(prompt))
        if not stack:
            raise Desync("a row started without the prompt-cache lookup rank 0 made for it")
        cache, rest = stack.pop()
        if not stack:
            del self.prefetched[tuple(prompt)]
        if spec.cached >= 0:
            cache, rest = cut_prefix(cache, prompt, rest, spec.cached)
        return cache, rest

    def _insert(self, op: Insert) -> None:
        loaded = self._model()
        cache, rest = self._take_prefetched(op.row)
        if self.batch is None:
            self.batch = BatchLane(loaded, self.batch_settings, faults=self.faults, paced=False)
        row = follower_row(op.row, loaded)
        self.batch.insert(row, cache, rest)
        if row.uid != op.uid:
            raise Desync(f"batch row uid {row.uid} here, {op.uid} on rank 0")

    def _remove(self, op: Remove) -> None:
        if self.batch is None:
            raise Desync("rank 0 removed batch rows this rank does not have")
        rows = [self.batch.rows[uid] for uid in op.uids if uid in self.batch.rows]
        if len(rows) != len(op.uids):
            raise Desync(f"rank 0 removed rows {op.uids}; this rank has {sorted(self.batch.rows)}")
        caches = self.batch.remove(rows, return_caches=op.caches)
        for cache, tokens in caches.values() if op.caches else ():
            if tokens:
                self._released(list(tokens), cache)

    def _start_serial(self, op: StartSerial) -> None:
        loaded = self._model()
        cache, rest = self._take_prefetched(op.row)
        self.serial_tokens = []
        self.serial = SerialRun(
            loaded,
            follower_row(op.row, loaded),
            cache,
            rest,
            prefill_step_size=self.batch_settings.prefill_step_size,
            pump=lambda: None,
            faults=self.faults,
        )

    def _end_serial(self) -> None:
        run = self.serial
        if run is not None:
            run.close()
            self._released(run.row.prompt + self.serial_tokens, run.cache)
        self.serial = None

    def _store(self, op: Store) -> None:
        found = self.released.get((op.n, op.crc))
        if found is None:
            raise Desync(f"rank 0 stored a cache of {op.n} tokens that this rank never made")
        tokens, cache = found
        self._model()
        self.cache.insert(list(tokens), cache)

    def _released(self, tokens: list[int], cache: Any) -> None:
        self.released[(len(tokens), tokens_crc(tokens))] = (tokens, cache)

    def _model(self) -> LoadedModel:
        if self.loaded is None:
            raise Desync("rank 0 used a model this rank has not loaded")
        return self.loaded

    # ------------------------------------------------------------ loading

    def load(self, op: Load) -> None:
        """Drop the old model's lanes and caches, then load this rank's shard of the new one."""
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        if self.serial is not None:
            self.serial.close()
            self.serial = None
        self.prefetched.clear()
        self.cache.clear()
        self.loaded = None
        model = ModelSettings(**op.model)
        path, _ = resolve_model_path(model, optimized_blas=self.optimized_blas)
        check_shardable(path, op.sharding, self.col.size)
        self.loaded = load_model(
            model,
            optimized_blas=self.optimized_blas,
            generation=op.generation,
            loader=make_loader(self.col.group, op.sharding),
        )
        logger.info("rank %d loaded its %s shard of %s", self.col.rank, op.sharding, path)

    def release(self) -> None:
        """Let go of the model, the lanes and every cache (the follower is leaving)."""
        if self.batch is not None:
            try:
                self.batch.close()
            except Exception:
                logger.debug("closing the batch", exc_info=True)
        self.batch = None
        self.serial = None
        self.loaded = None
        self.prefetched.clear()
        self.released.clear()
        self.cache.clear()

    # ------------------------------------------------------------ steps

    def step_batch(self) -> None:
        """Run the batch step rank 0 planned."""
        if self.batch is None:
            raise Desync("rank 0 stepped a batch this rank does not have")
        try:
            outs = self.batch.step()
        except Exception as exc:
            if is_collective_error(exc):
                raise
            # Rank 0's step failed the same way; its ResetBatch comes next.
            logger.warning("the batched step failed here too: %s", exc)
            self.checksum.step()
            return
        for out in outs:
            if out.finish_reason is not None and out.all_tokens:
                self._released(list(out.all_tokens), out.cache)
        self.checksum.add([o.token for o in outs])
        self.checksum.step()

    def step_serial(self) -> None:
        """Advance the serial row by the one token rank 0 planned."""
        if self.serial is None:
            raise Desync("rank 0 stepped a serial row this rank does not have")
        try:
            token = self.serial.advance()
        except Exception as exc:
            if is_collective_error(exc):
                raise
            logger.warning("the serial step failed here too: %s", exc)
            token = None
        if token is not None:
            self.serial_tokens.append(token)
            self.checksum.add([token])
        self.checksum.step()
