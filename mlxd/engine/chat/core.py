"""The engine thread's state: the served model, both lanes, the prompt cache, the counters.

:class:`EngineCore` is owned by one thread (see :mod:`mlxd.engine.chat.engine_thread`).
It holds what the step modules work on (:mod:`~mlxd.engine.chat.step` carries
out the scheduler's plan, :mod:`~mlxd.engine.chat.batch_step` and
:mod:`~mlxd.engine.chat.serial_step` run the lanes, :mod:`~mlxd.engine.chat.enqueue`
queues requests) and the few changes they share: how a row ends and is
counted, cancelling, installing and releasing a model. The queues, the KV
budget, priority, preemption and drains are its scheduler's
(:class:`~mlxd.engine.chat.scheduler.Scheduler`, ``core.scheduler``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mlxd.config import Settings
from mlxd.engine.channel import Channel
from mlxd.engine.chat import checkpoints
from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.counters import Counters, Peaks, Throughput
from mlxd.engine.chat.engine_lanes import EngineLanes
from mlxd.engine.chat.grammar import GrammarFailure
from mlxd.engine.chat.hooks import ClusterHooks
from mlxd.engine.chat.kv_caches import compact
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.prompt_cache import Fetched, Kind
from mlxd.engine.chat.prompt_disk import DiskTier, model_identity
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.scheduler import Scheduler
from mlxd.engine.chat.serial import SerialRun
from mlxd.engine.memory import MemoryPool
from mlxd.engine.messages import Admitted, ErrorCode, Failed
from mlxd.engine.snapshot import RecentLookup

logger = logging.getLogger(__name__)

# Lookups kept for /stats and the dashboard (newest first).
RECENT_LOOKUPS = 32


class EngineCore:
    """The served model, the lanes and the prompt cache, owned by the engine thread.

    Args:
        settings: The live settings (replaced by :meth:`apply`).
        hooks: What the engine runs on (builds the lanes and the prompt cache).
        pump: Processes the inbox during a long serial prefill.
        pool: The memory budget shared with other loaded models
            (:mod:`mlxd.engine.memory`); None: this engine's
            ``[batch] kv_budget`` alone. ``pool_id`` names this engine in it.
        faults: Honour ``GenerationRequest.fault`` (tests only).
        runtime: Facts about the process (BLAS, device) for the snapshot.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        hooks: ClusterHooks,
        pump: Callable[[], None],
        pool: MemoryPool | None = None,
        pool_id: str = "",
        faults: bool = False,
        runtime: dict[str, Any] | None = None,
    ):
        self.settings = settings
        self.hooks = hooks
        self.pump = pump
        self.pool = pool
        self.scheduler = Scheduler(settings, pool=pool, pool_id=pool_id, faults=faults)
        self.lanes = EngineLanes(self)
        self.faults = faults
        self.started_wall = time.time()
        self.runtime = dict(runtime or {})
        self.loaded: LoadedModel | None = None
        self.model_status = "loading"
        self.model_error: str | None = None
        self.batch: BatchLane | None = None
        self.serial: SerialRun | None = None
        self.prompt_cache = hooks.make_prompt_cache(
            settings.prompt_cache, lambda: self.settings.batch
        )
        self.lookups: deque[RecentLookup] = deque(maxlen=RECENT_LOOKUPS)
        # [prompt_cache] volatile_rules applied to admitted requests, by rule.
        self.rule_counts: dict[str, int] = {}
        self.counters = Counters()
        self.throughput = Throughput()
        self.peaks = Peaks()
        self.accepting = True
        # Requests the intake thread is tokenizing (set by the engine thread).
        self.intaking = 0
        self.max_active_seen = 0
        self.last_step_wall = time.time()
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.avg_generated = float(settings.sampling.max_tokens)

    @property
    def pool_id(self) -> str:
        """This engine's name in the shared memory pool (a rename changes it)."""
        return self.scheduler.budget.pool_id

    @pool_id.setter
    def pool_id(self, value: str) -> None:
        self.scheduler.budget.pool_id = value

    @property
    def busy(self) -> bool:
        return bool(
            self.scheduler.has_work or self.serial or (self.batch is not None and len(self.batch))
        )

    def lane_idle(self) -> bool:
        """Nothing runs in either lane: a refused request waits for no row to end."""
        return (self.batch is None or not len(self.batch)) and self.serial is None

    def note_error(self, message: str) -> None:
        """Remember the latest engine error (the status bar shows it, with its time)."""
        self.last_error, self.last_error_at = message, time.time()

    def memory(self) -> dict[str, int]:
        """MLX's allocator bytes; read on the engine thread, empty before a model loads."""
        if self.loaded is None:
            return {}
        from mlxd.engine.chat.loading import allocator_bytes

        return allocator_bytes()

    # ------------------------------------------------------------ model and settings

    def install_model(self, loaded: LoadedModel) -> None:
        """Make ``loaded`` the served model; both lanes must be idle."""
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        self.prompt_cache.detach_disk()  # the old model's entries go to disk first
        self.prompt_cache.clear()
        self.loaded = loaded
        self.model_status = "ready"
        self.model_error = None
        self.prompt_cache.attach_disk(self._open_disk())
        self.scheduler.update_room(self.lanes)

    def apply(self, settings: Settings) -> None:
        """Apply policy keys between two steps; rows already running keep running.

        Queued requests that the new budget can never hold are refused now.
        """
        before = _disk_key(self.settings)
        self.settings = settings
        new = settings.prompt_cache
        disk = self.prompt_cache.disk
        if before != _disk_key(settings) or (disk is not None and disk.state != "on"):
            self.prompt_cache.detach_disk()
            self.prompt_cache.attach_disk(self._open_disk())
        self.prompt_cache.configure(new, self.live_bytes())
        if self.batch is not None:
            self.batch.configure(settings.batch)
            self.batch.speculate(settings.speculative)
        self.scheduler.apply(settings, self.lanes)

    def release(self) -> None:
        """Drop every MLX object; called on the engine thread before it exits.

        MLX arrays made on the engine thread must not outlive it: freeing one
        at interpreter exit, after the thread's stream is gone, aborts the
        process.
        """
        if self.batch is not None:
            self.batch.close()
        self.batch = None
        self.serial = None
        self.prompt_cache.detach_disk()  # what RAM holds goes to disk before it is dropped
        self.prompt_cache.clear()
        self.loaded = None

    # ------------------------------------------------------------ KV bytes

    def live_bytes(self) -> int:
        """Real KV bytes the batch holds now."""
        return self.batch.nbytes if self.batch is not None else 0

    def kv_bytes(self) -> int:
        """Real KV bytes of both lanes now."""
        return self.live_bytes() + (self.serial.nbytes if self.serial is not None else 0)

    def note_kv(self, *, after_step: bool) -> None:
        """Record the KV bytes held now (after an admission or a step): the peak, and
        steps that ended over the budget (rows generating past their decode allowance)."""
        if self.scheduler.update_from_output(self.kv_bytes(), after_step=after_step):
            self.counters.kv_over_budget_steps += 1

    def sample_peaks(self) -> None:
        """Record the KV bytes and queue length now, for the dashboard's sparklines."""
        queued = len(self.scheduler.pending) + len(self.scheduler.serial_queue)
        self.peaks.add(self.kv_bytes(), queued, time.time())
        self.scheduler.sample(self.lanes)

    # ------------------------------------------------------------ prompt cache

    def fetch_cache(self, prompt: list[int]) -> Fetched:
        """The nearest cached prefix of ``prompt`` (RAM or disk) and the tokens left to prefill."""
        if self.loaded is None:
            return Fetched(None, prompt, "none", 0, 0)
        fetched = self.prompt_cache.fetch(prompt)
        compact(fetched.cache)  # a copy cut back still holds the stored entry's full length
        if fetched.source == "disk":  # what was read is kept in RAM too: back under the cap
            self.prompt_cache.trim(self.live_bytes())
        return fetched

    def cuts(self, row: Row, cached: int) -> tuple[int, ...]:
        """Where ``row``'s prefill stops for checkpoints, starting from ``cached`` tokens."""
        return tuple(p for p, _ in self.plan_checkpoints(row, cached))

    def plan_checkpoints(self, row: Row, cached: int) -> list[tuple[int, Kind]]:
        """Where ``row``'s prefill keeps checkpoints, starting from ``cached`` tokens."""
        loaded = self.loaded
        assert loaded is not None
        if loaded.rewindable or not self.prompt_cache.enabled or not self.hooks.checkpoints:
            return []
        return checkpoints.plan(
            len(row.prompt),
            cached,
            system_end=row.system_end,
            prompt_end=row.prompt_end,
            every=self.settings.prompt_cache.checkpoint_every,
        )

    def admit_lookup(self, row: Row, fetched: Fetched) -> None:
        """``row`` leaves its queue from ``fetched``: tell its client, remember the lookup.

        Also plans the checkpoints its prefill keeps (``row.checkpoints``).
        """
        loaded = self.loaded
        assert loaded is not None
        cached = len(row.prompt) - len(fetched.rest)
        if row.resumed:  # a preempted row: its client was told long ago; it goes on decoding
            row.resumed, row.started_mono = False, time.monotonic()
            row.prefill_done, row.prefill_total = 0, len(fetched.rest)
            row.phase = "decode"
            self.counters.resumed += 1
            return
        row.admitted(cached)
        lookup = checkpoints.lookup(fetched, row.prompt, loaded.tokenizer)
        row.lookup = lookup
        row.channel.push(Admitted(lookup))
        self.lookups.appendleft(
            RecentLookup(
                row.id,
                loaded.info.id,
                row.request.api,
                time.time(),
                lookup,
                row.request.prompt_rules,
            )
        )
        for rule in row.request.prompt_rules:
            self.rule_counts[rule] = self.rule_counts.get(rule, 0) + 1
        row.checkpoints = self.plan_checkpoints(row, cached)

    def store_checkpoint(self, tokens: list[int], cache: list[Any], kind: Kind) -> None:
        """Keep a cache taken at a prompt boundary while it was prefilled."""
        if self.loaded is not None:
            self.prompt_cache.store(tokens, cache, self.live_bytes(), kind)

    def store_cache(self, tokens: list[int] | None, cache: list[Any] | None) -> None:
        """Keep a finished row's cache for the prompts that share its prefix."""
        if self.loaded is not None:
            self.prompt_cache.store(tokens, cache, self.live_bytes())

    def _open_disk(self) -> DiskTier | None:
        """The loaded model's disk tier, when the settings and the machines allow one."""
        s, loaded = self.settings.prompt_cache, self.loaded
        on, root = _disk_key(self.settings)
        if loaded is None or not on or not self.hooks.disk_tier:
            return None
        try:
            dtype = loaded.info.dtype
            if loaded.kv_quant is not None:  # entries of other KV bits are not this model's
                dtype += "+kv{}g{}".format(*loaded.kv_quant)
            identity = model_identity(loaded.info.path, dtype, loaded.cache_classes)
            return DiskTier(
                root,
                identity,
                s.disk_max_bytes,
                name=f"mlxd-disk-{self.pool_id or 'model'}",
                max_entries=s.disk_max_entries,
            )
        except Exception as exc:  # an unreadable model directory, a broken disk: RAM only
            logger.warning("the prompt cache's disk tier is off: %s", exc)
            return None

    # ------------------------------------------------------------ cancel

    def cancel(self, request_id: str) -> None:
        """Remove a request wherever it is; a running row leaves before the next step."""
        for row in self.scheduler.finish_requests(request_id):
            self.cancelled(row)
            return
        if self.serial is not None and self.serial.row.id == request_id:
            self.serial.row.cancelled = True
            return
        if self.batch is not None:
            for row in list(self.batch.rows.values()):
                if row.id == request_id:
                    keep = row.first_token_mono is None and self.hooks.checkpoints
                    kept = self.batch.remove([row], return_caches=keep)
                    cache, tokens = kept.get(row.uid or 0, (None, None))
                    self.keep_prefill(row, tokens, cache)
                    self.cancelled(row)
                    return

    def keep_prefill(self, row: Row, tokens: list[int] | None, cache: list[Any] | None) -> None:
        """Keep what a row cancelled during its prefill has prefilled (whole chunks).

        Its client gave up (an agent's stream watchdog, a closed tab) and will
        likely send the same prompt again: stored as a ``checkpoint`` entry
        (the first kind to leave RAM, within ``max_bytes``), the retry goes
        on from where this one stopped instead of from token 0. Not in a
        cluster (every rank would have to keep it alike) nor for a row with
        images.
        """
        if tokens is None or cache is None or row.first_token_mono is not None:
            return
        if row.images is not None or not self.hooks.checkpoints:
            return
        n = len(tokens)
        if not row.cached_tokens < n < len(row.prompt) or list(tokens) != row.prompt[:n]:
            return
        self.store_checkpoint(list(tokens), cache, "checkpoint")
        logger.info("%s cancelled after prefilling %d tokens: kept", row.id, n)

    # ------------------------------------------------------------ endings

    def complete(
        self, row: Row, reason: Literal["stop", "length"], *, stopped_by_string: bool = False
    ) -> None:
        """``row`` ended on its own: finish it and count it."""
        row.finish(reason, stopped_by_string=stopped_by_string)
        c = self.counters
        c.outcome(row.lane, "completed")
        c.prompt_tokens += row.prompt_tokens
        c.generated_tokens += row.generated
        c.cached_tokens += row.cached_tokens
        c.tool_calls += row.output.calls
        c.tool_call_parse_failures += row.output.failed_calls
        c.images += row.images.count if row.images is not None else 0
        c.vision_seconds += row.vision_seconds
        self.avg_generated = 0.9 * self.avg_generated + 0.1 * row.generated

    def fail(
        self, row: Row, message: str, *, code: ErrorCode = "generation_error", status: int = 500
    ) -> None:
        """End ``row`` with an error; a grammar that failed it answers for itself (a 400)."""
        if isinstance(row.error, GrammarFailure):
            code, status, message = row.error.code, row.error.status, str(row.error)
        self.counters.outcome(row.lane, "failed")
        row.fail(Failed(code, message, status))

    def cancelled(self, row: Row) -> None:
        """End ``row`` as its client asked."""
        row.cancelled = True
        self.counters.outcome(row.lane, "cancelled")
        row.fail(Failed("cancelled", "the request was cancelled", 499))

    def refuse(self, channel: Channel, failed: Failed) -> None:
        """Refuse a request before it was queued."""
        self.counters.reject(failed.code)
        channel.push(failed)

    def abort_all(
        self, message: str, *, code: ErrorCode = "shutting_down", status: int = 503
    ) -> None:
        """End every request, queued or running, with an error (shutdown, fatal errors)."""
        if self.serial is not None:
            self.serial.close()
            self.fail(self.serial.row, message, code=code, status=status)
            self.serial = None
        if self.batch is not None:
            for row in self.batch.reset(self.settings.batch):
                self.fail(row, message, code=code, status=status)
        for row in self.scheduler.finish_requests():
            self.fail(row, message, code=code, status=status)


def _disk_key(settings: Settings) -> tuple[bool, Path]:
    """Whether the disk tier is on, and its directory (a change of either reopens it)."""
    s = settings.prompt_cache
    on = s.disk and s.disk_max_bytes > 0 and s.max_entries > 0 and s.max_bytes > 0
    root = (
        Path(s.disk_dir).expanduser() if s.disk_dir else settings.server.state_path / "prompt-cache"
    )
    return on, root
