"""A cluster rank other than 0: apply rank 0's plans to this rank's shard.

A follower serves no API and makes no decisions. Its engine thread joins
the group, then loops: receive a :class:`~mlxd.engine.cluster.plan.Plan`, apply
its operations to its own batch lane, serial run and prompt cache (the same
classes rank 0 uses, so the caches stay in lockstep), run the planned step,
and compare digests when asked. It exits 0 on rank 0's ``Shutdown``, and
non-zero when a collective fails, the digests disagree, or no plan arrives
for ``step_timeout`` seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from mlxd.config import BatchSettings, ModelSettings, PromptCacheSettings, Settings
from mlxd.engine.channel import Channel
from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.intake import constraint_processor
from mlxd.engine.chat.loading import LoadedModel, load_model
from mlxd.engine.chat.prompt_cache import PromptCache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.serial import SerialRun
from mlxd.engine.cluster.join import ClusterError, Membership, check_shardable, join, make_loader
from mlxd.engine.cluster.plan import (
    Collectives,
    Configure,
    EndSerial,
    Fetch,
    Insert,
    Load,
    Op,
    Plan,
    Remove,
    ResetBatch,
    RowSpec,
    Seed,
    Shutdown,
    StartSerial,
    Store,
    TokenChecksum,
    Trim,
    compare_digests,
    decode_plan,
    is_collective_error,
    local_digest,
    tokens_crc,
)
from mlxd.engine.messages import (
    Constraint,
    Failed,
    GenerationRequest,
    PenaltyParams,
    SamplingParams,
    TokenPrompt,
)

logger = logging.getLogger(__name__)

EXIT_LOST = 3


class Desync(Exception):
    """This rank's state does not match what rank 0's plan expects."""


class _NullChannel(Channel):
    """A follower's rows have no reader: their events go nowhere."""

    def __init__(self) -> None:
        self.reader_gone = True

    def push(self, event: Any) -> None:
        return None


class _MirrorCache(PromptCache):
    """A follower's prompt cache: rank 0 decides every store and eviction.

    Byte counts differ between shards (pipeline stages hold different
    layers), so this cache never evicts by bytes on its own; ``Trim``
    ops from rank 0 say how many entries to keep.
    """

    def configure(self, settings: PromptCacheSettings, live_bytes: int) -> None:
        self._settings = settings
        self._lru.max_size = settings.max_entries
        self._lru.max_bytes = 2**62

    def insert(self, model_key: str, tokens: list[int], cache: Any) -> None:
        self._lru.insert_cache(model_key, tokens, cache)

    def keep(self, entries: int) -> None:
        self._lru.trim_to(n_sequences=entries)


def _row(spec: RowSpec, loaded: LoadedModel) -> Row:
    constraint = Constraint(*spec.constraint) if spec.constraint else None  # type: ignore[arg-type]
    request = GenerationRequest(
        id=spec.id,
        prompt=TokenPrompt(tuple(spec.prompt)),
        max_tokens=spec.max_tokens,
        sampling=SamplingParams(spec.temperature, spec.top_p, spec.top_k, spec.min_p, spec.seed),
        penalties=PenaltyParams(
            spec.repetition_penalty,
            spec.presence_penalty,
            spec.frequency_penalty,
            tuple((int(k), float(v)) for k, v in spec.logit_bias),
        ),
        logprobs=spec.logprobs,
        top_logprobs=spec.top_logprobs,
        fault=spec.fault,
        constraint=constraint,
    )
    matcher = None
    if constraint is not None:
        # The same grammar mask rank 0 applies: every rank must sample the same tokens.
        phase = "reasoning" if spec.reasoning else "normal"
        matcher = constraint_processor(loaded, constraint, phase)
        if isinstance(matcher, Failed):
            raise Desync(f"this rank cannot build the row's grammar: {matcher.message}")
    now = time.monotonic()
    return Row(
        request=request,
        channel=_NullChannel(),
        lane=spec.lane,  # type: ignore[arg-type]
        reason="cluster",
        prompt=list(spec.prompt),
        max_tokens=spec.max_tokens,
        text=None,  # type: ignore[arg-type]
        tokenizer=None,
        output=None,  # type: ignore[arg-type]
        matcher=matcher,
        received_mono=now,
        received_wall=time.time(),
    )


class Follower:
    """One follower rank; :meth:`run` is its engine thread's body."""

    def __init__(
        self, settings: Settings, member: Membership, *, optimized_blas: bool, faults: bool
    ):
        assert settings.cluster is not None
        self.settings = settings.cluster
        self.member = member
        self.optimized_blas = optimized_blas
        self.faults = faults
        self.col: Collectives | None = None
        self.loaded: LoadedModel | None = None
        self.batch_settings = settings.batch
        self.cache = _MirrorCache(PromptCacheSettings(max_entries=0))
        self.batch: BatchLane | None = None
        self.serial: SerialRun | None = None
        self.serial_tokens: list[int] = []
        # Prompt-cache lookups waiting for their row, newest last, by prompt.
        self.prefetched: OrderedDict[tuple[int, ...], list[tuple[Any, list[int]]]] = OrderedDict()
        # Caches rows released since the last plan, for Store: (n, crc) -> (tokens, cache).
        self.released: dict[tuple[int, int], tuple[list[int], Any]] = {}
        self.checksum = TokenChecksum()
        # When the last plan arrived; None while loading (which may take minutes).
        self.last_plan: float | None = None
        self.stopping = threading.Event()

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """Join, then apply plans until rank 0 says shutdown. Returns the exit code."""
        try:
            group = join(self.member, self.settings.join_timeout)
            self.col = Collectives(group)
            hosts = self.col.gather_text(socket.gethostname())
            logger.info(
                "rank %d of %d joined (%s); waiting for rank 0's plans",
                self.col.rank,
                self.col.size,
                ", ".join(hosts),
            )
            self._watch()
            self.last_plan = time.monotonic()
            while True:
                data = self.col.broadcast(None)
                self.last_plan = time.monotonic()
                if not data:
                    raise Desync("received an empty plan")
                plan = decode_plan(data)
                if self._apply(plan):
                    logger.info("rank 0 shut the cluster down; exiting")
                    return 0
        except ClusterError as exc:
            logger.error("%s", exc)
            return 2
        except Desync as exc:
            logger.error("cluster: this rank fell out of step with rank 0: %s", exc)
            return EXIT_LOST
        except Exception as exc:
            if is_collective_error(exc):
                logger.error("cluster: rank 0 or a peer was lost: %s", exc)
            else:
                logger.exception("cluster follower failed")
            return EXIT_LOST
        finally:
            self.last_plan = None
            self._release()

    def _apply(self, plan: Plan) -> bool:
        stop = False
        for op in plan.ops:
            if isinstance(op, Shutdown):
                stop = True
            else:
                self._op(op)
        self.released.clear()
        if plan.run == "batch":
            self._step_batch()
        elif plan.run == "serial":
            self._step_serial()
        if plan.digest:
            assert self.col is not None
            rows = self.col.gather(local_digest(plan.seq, self.checksum).values())
            why = compare_digests(rows)
            if why is not None:
                raise Desync(why)
        return stop

    # ------------------------------------------------------------ ops

    def _op(self, op: Op) -> None:
        if isinstance(op, Seed):
            import mlx.core as mx

            mx.random.seed(op.value)
        elif isinstance(op, Configure):
            self.batch_settings = BatchSettings(**op.batch)
            cache = PromptCacheSettings(**op.prompt_cache)
            self.cache.configure(cache, 0)
            if self.batch is not None:
                self.batch.configure(self.batch_settings)
        elif isinstance(op, Load):
            self._load(op)
        elif isinstance(op, Fetch):
            assert self.loaded is not None
            cache, rest = self.cache.fetch(self.loaded.key, op.prompt)
            got = len(op.prompt) - len(rest)
            if got != op.cached:
                raise Desync(f"prompt cache hit {got} tokens here, {op.cached} on rank 0")
            self.prefetched.setdefault(tuple(op.prompt), []).append((cache, rest))
            while sum(len(v) for v in self.prefetched.values()) > 8:
                key = next(iter(self.prefetched))
                self.prefetched[key].pop(0)
                if not self.prefetched[key]:
                    del self.prefetched[key]
        elif isinstance(op, Insert):
            self._insert(op)
        elif isinstance(op, Remove):
            self._remove(op)
        elif isinstance(op, ResetBatch):
            if self.batch is not None:
                self.batch.reset(self.batch_settings)
        elif isinstance(op, StartSerial):
            assert self.loaded is not None
            cache, rest = self._take_prefetched(op.row.prompt)
            row = _row(op.row, self.loaded)
            self.serial_tokens = []
            self.serial = SerialRun(
                self.loaded,
                row,
                cache,
                rest,
                prefill_step_size=self.batch_settings.prefill_step_size,
                pump=lambda: None,
                faults=self.faults,
            )
        elif isinstance(op, EndSerial):
            run = self.serial
            if run is not None:
                run.close()
                tokens = run.row.prompt + self.serial_tokens
                self.released[(len(tokens), tokens_crc(tokens))] = (tokens, run.cache)
            self.serial = None
        elif isinstance(op, Store):
            found = self.released.get((op.n, op.crc))
            if found is None:
                raise Desync(f"rank 0 stored a cache of {op.n} tokens that this rank never made")
            assert self.loaded is not None
            tokens, cache = found
            self.cache.insert(self.loaded.key, list(tokens), cache)
        elif isinstance(op, Trim):
            self.cache.keep(op.entries)
        else:  # pragma: no cover - a plan from a newer rank 0
            raise Desync(f"unknown operation {type(op).__name__}")

    def _take_prefetched(self, prompt: list[int]) -> tuple[Any, list[int]]:
        stack = self.prefetched.get(tuple(prompt))
        if not stack:
            raise Desync("a row started without the prompt-cache lookup rank 0 made for it")
        found = stack.pop()
        if not stack:
            del self.prefetched[tuple(prompt)]
        return found

    def _insert(self, op: Insert) -> None:
        assert self.loaded is not None
        cache, rest = self._take_prefetched(op.row.prompt)
        if self.batch is None:
            self.batch = BatchLane(self.loaded, self.batch_settings, faults=self.faults)
        row = _row(op.row, self.loaded)
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
                self.released[(len(tokens), tokens_crc(list(tokens)))] = (list(tokens), cache)

    def _load(self, op: Load) -> None:
        self.last_plan = None  # loading a big shard may take longer than a step
        try:
            self._load_shard(op)
        finally:
            self.last_plan = time.monotonic()

    def _load_shard(self, op: Load) -> None:
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
        assert self.col is not None
        from mlxd.engine.chat.loading import resolve_model_path

        path, _ = resolve_model_path(model, optimized_blas=self.optimized_blas)
        check_shardable(path, op.sharding, self.col.size)
        self.loaded = load_model(
            model,
            optimized_blas=self.optimized_blas,
            generation=op.generation,
            loader=make_loader(self.col.group, op.sharding),
        )
        logger.info("rank %d loaded its %s shard of %s", self.col.rank, op.sharding, path)

    # ------------------------------------------------------------ steps

    def _step_batch(self) -> None:
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
                tokens = list(out.all_tokens)
                self.released[(len(tokens), tokens_crc(tokens))] = (tokens, out.cache)
        self.checksum.add([o.token for o in outs])
        self.checksum.step()

    def _step_serial(self) -> None:
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

    # ------------------------------------------------------------ lifecycle

    def _watch(self) -> None:
        timeout = self.settings.step_timeout

        def loop() -> None:
            while True:
                since = self.last_plan
                if since is not None and time.monotonic() - since > timeout:
                    # Rank 0 plans every step and heartbeats every 100 ms when idle.
                    logger.error(
                        "cluster: no plan from rank 0 for step_timeout (%gs): rank 0 is "
                        "unreachable or stuck; exiting",
                        timeout,
                    )
                    _exit(EXIT_LOST)
                time.sleep(min(1.0, timeout / 10))

        threading.Thread(target=loop, name="mlxd-cluster-watchdog", daemon=True).start()

    def _release(self) -> None:
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


def _exit(code: int) -> None:
    logging.shutdown()
    os._exit(code)


def run_follower(
    settings: Settings, member: Membership, *, optimized_blas: bool, faults: bool
) -> int:
    """Run a follower rank until rank 0 shuts it down; returns the exit code.

    The follower's loop runs on its own engine thread (it owns MLX); this
    thread waits for it. SIGTERM here waits a while for rank 0's shutdown
    plan (the group stops together), then leaves with 0.
    """
    import signal

    follower = Follower(settings, member, optimized_blas=optimized_blas, faults=faults)
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(follower.run()), name="mlxd-engine", daemon=True
    )

    def on_term(sig: int, frame: Any) -> None:
        if follower.stopping.is_set():
            _exit(1)
        follower.stopping.set()
        logger.info(
            "%s received: waiting for rank 0 to shut the cluster down", signal.Signals(sig).name
        )

        def later() -> None:
            time.sleep(30)
            logger.warning("rank 0 sent no shutdown within 30s; exiting")
            _exit(0)

        threading.Thread(target=later, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_term)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    return result[0] if result else EXIT_LOST
