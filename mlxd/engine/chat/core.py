"""The engine thread's state and its step.

:class:`EngineCore` is driven by one thread (see :mod:`mlxd.engine.chat.engine`):
``intake`` takes new requests, ``cancel`` removes rows, ``tick`` plans the
lanes, admits, runs one step and publishes a snapshot. Policy comes from the
pure modules (``lanes``, ``admission``, ``drain``); this module composes them
and owns every MLX object.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mlxd.config import Settings
from mlxd.engine.channel import Channel
from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.intake import Prepared, prepare
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.output import make_output
from mlxd.engine.chat.prompt_cache import PromptCache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.serial import SerialRun
from mlxd.engine.chat.stops import TextStream
from mlxd.engine.fleet.memory import MemoryPool
from mlxd.engine.messages import Accepted, Failed, GenerationRequest
from mlxd.engine.policy import admission
from mlxd.engine.policy.drain import DrainLog, LaneState, plan
from mlxd.engine.snapshot import Counters, Peaks, Throughput

logger = logging.getLogger(__name__)


class EngineCore:
    """Lanes, queues, drain and admission, owned by the engine thread."""

    def __init__(
        self,
        settings: Settings,
        *,
        faults: bool = False,
        runtime: dict[str, Any] | None = None,
    ):
        self.settings = settings
        self.faults = faults
        self.started_wall = time.time()
        self.runtime = dict(runtime or {})
        self.loaded: LoadedModel | None = None
        self.model_status = "loading"
        self.model_error: str | None = None
        self.batch: BatchLane | None = None
        self.serial: SerialRun | None = None
        self.pending: deque[Row] = deque()
        self.serial_queue: deque[Row] = deque()
        # Exclusive calls (a model swap) wait for both lanes to be idle.
        self.exclusive: deque[tuple[str, Callable[[], None]]] = deque()
        self.prompt_cache = PromptCache(settings.prompt_cache)
        self.drains = DrainLog()
        self.counters = Counters()
        self.throughput = Throughput()
        self.peaks = Peaks()
        self.last_turn = "batch"
        self.waiting_for: str | None = None
        self.accepting = True
        # Requests the intake thread is tokenizing (set by the engine).
        self.intaking = 0
        self.budget_bytes = 0
        self.max_active_seen = 0
        self.max_kv_seen = 0
        self.last_step_wall = time.time()
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.avg_generated = float(settings.sampling.max_tokens)
        # Set by the engine: processes the inbox during a long serial prefill.
        self.pump: Callable[[], None] = lambda: None
        # What builds the lanes; a cluster's rank 0 swaps in mirrored ones
        # that broadcast each step (mlxd.engine.cluster.leader).
        self.batch_factory: Callable[..., BatchLane] = BatchLane
        self.serial_factory: Callable[..., SerialRun] = SerialRun
        # The memory budget shared with other loaded models (mlxd.engine.fleet.memory),
        # set by the fleet; None: this engine's [batch] kv_budget alone.
        self.pool: MemoryPool | None = None
        self.pool_id = ""

    def sample_peaks(self) -> None:
        """Record the KV bytes and queue length now, for the dashboard's sparklines."""
        kv = self._live_bytes() + (self.serial.nbytes if self.serial is not None else 0)
        self.peaks.add(kv, len(self.pending) + len(self.serial_queue), time.time())
        if self.pool is not None:
            self.pool.report_kv(self.pool_id, self._kv_claim())
            self.budget_bytes = self._budget()

    def _kv_claim(self, candidate: int | None = None) -> int:
        """The KV bytes this engine holds or may grow to: its claim on a shared pool."""
        serial = self.serial.nbytes if self.serial is not None else 0
        if candidate is not None:
            return candidate + serial
        if self.batch is None or self.loaded is None or not len(self.batch):
            return self._live_bytes() + serial
        projected = admission.project_batch_bytes(
            self.loaded.layout,
            [r.extent for r in self.batch.rows.values()],
            self.settings.batch.prefill_step_size,
        )
        return max(projected, self._live_bytes()) + serial

    def memory(self) -> dict[str, int]:
        """MLX's allocator bytes; read on the engine thread, empty before a model loads."""
        if self.loaded is None:
            return {}
        from mlxd.engine.chat.loading import memory_view

        return memory_view()

    def note_error(self, message: str) -> None:
        """Remember the latest engine error (the status bar shows it, with its time)."""
        self.last_error, self.last_error_at = message, time.time()

    # ------------------------------------------------------------ model

    def install_model(self, loaded: LoadedModel) -> None:
        """Make ``loaded`` the served model; both lanes must be idle."""
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        self.loaded = loaded
        self.model_status = "ready"
        self.model_error = None
        self.prompt_cache.clear()
        self.budget_bytes = self._budget()

    def _budget(self) -> int:
        kv = self.settings.batch.kv_budget
        if self.pool is not None:
            ceiling = self.pool.kv_ceiling(self.pool_id)
            return ceiling if kv == "auto" else min(int(kv), ceiling)
        if kv != "auto":
            return int(kv)
        from mlxd.engine.chat.loading import device_memory_bytes

        weights = self.loaded.weights_bytes if self.loaded else 0
        return admission.auto_budget(
            device_memory_bytes(), weights, self.settings.prompt_cache.max_bytes
        )

    def apply(self, settings: Settings) -> None:
        """Apply policy keys between two steps; rows already running keep running."""
        self.settings = settings
        self.prompt_cache.configure(settings.prompt_cache, self._live_bytes())
        if self.batch is not None:
            self.batch.configure(settings.batch)
        self.budget_bytes = self._budget()

    # ------------------------------------------------------------ intake

    def intake(
        self,
        request: GenerationRequest,
        channel: Channel,
        prepared: Prepared | Failed | None = None,
    ) -> None:
        """Queue a new request, or refuse it with a clear error.

        ``prepared`` is the request tokenized and checked by the intake
        thread; without it, intake prepares the request here.
        """
        now_mono, now_wall = time.monotonic(), time.time()
        if not self.accepting:
            return self._refuse(
                channel, Failed("shutting_down", "the server is shutting down", 503)
            )
        loaded = self.loaded
        if loaded is None:
            why = self.model_error or "the model is still loading"
            return self._refuse(
                channel, Failed("model_not_loaded", f"no model is loaded: {why}", 503)
            )
        if prepared is None:
            prepared = prepare(loaded, request, self.settings, self.budget_bytes)
        if isinstance(prepared, Failed):
            return self._refuse(channel, prepared)
        depth = self.waiting()
        if self._would_wait(prepared.decision.lane) and depth >= self.settings.limits.max_queued:
            message = f"{depth} requests are already waiting (limits.max_queued); retry later."
            return self._refuse(
                channel, Failed("queue_full", message, 429, retry_after=self._retry_after(depth))
            )
        row = self._row(loaded, request, channel, prepared, now_mono, now_wall)
        self.counters.submitted += 1
        reasons = self.counters.lane_reasons
        reasons[row.reason] = reasons.get(row.reason, 0) + 1
        apis = self.counters.by_api
        apis[request.api] = apis.get(request.api, 0) + 1
        if request.constraint is not None:
            kinds = self.counters.constrained_rows
            kinds[request.constraint.kind] = kinds.get(request.constraint.kind, 0) + 1
        channel.push(Accepted(row.lane, row.reason, len(row.prompt), loaded.info.id))
        (self.pending if row.lane == "batch" else self.serial_queue).append(row)

    def _free_slots(self) -> tuple[int, int]:
        """Rows each lane could start now: free batch slots, and the serial slot."""
        running = len(self.batch) if self.batch is not None else 0
        return max(0, self.settings.batch.size - running), 0 if self.serial is not None else 1

    def waiting(self) -> int:
        """Requests that wait for a slot: queued beyond what the lanes could start now.

        This is what ``[limits] max_queued`` bounds, so the bound holds
        whatever the arrival pattern (a burst that arrives before the next
        step is counted the same as a trickle).
        """
        free_batch, free_serial = self._free_slots()
        return max(0, len(self.pending) - free_batch) + max(0, len(self.serial_queue) - free_serial)

    def _would_wait(self, lane: str) -> bool:
        free_batch, free_serial = self._free_slots()
        if lane == "batch":
            return len(self.pending) >= free_batch
        return len(self.serial_queue) >= free_serial

    @staticmethod
    def _row(
        loaded: LoadedModel,
        request: GenerationRequest,
        channel: Channel,
        prepared: Prepared,
        now_mono: float,
        now_wall: float,
    ) -> Row:
        return Row(
            request=request,
            channel=channel,
            lane=prepared.decision.lane,
            reason=prepared.decision.reason,
            prompt=prepared.prompt,
            max_tokens=prepared.max_tokens,
            text=TextStream(loaded.tokenizer.detokenizer, request.stop),
            tokenizer=loaded.tokenizer,
            output=make_output(loaded, request, prepared.phase),
            matcher=prepared.constraint,
            received_mono=now_mono,
            received_wall=now_wall,
            extent=prepared.extent,
        )

    def retokenize_queued(self) -> None:
        """After a model swap: queued requests are tokenized again by the new model.

        A request keeps the lane its client was told, unless the new model
        cannot batch; one that no longer fits is failed with the reason.
        """
        loaded = self.loaded
        assert loaded is not None
        for queue in (self.pending, self.serial_queue):
            for row in list(queue):
                prepared = prepare(loaded, row.request, self.settings, self.budget_bytes)
                if isinstance(prepared, Failed):
                    queue.remove(row)
                    message = f"the new model cannot take this request: {prepared.message}"
                    self._fail(row, message, code=prepared.code, status=prepared.status)
                    continue
                row.prompt, row.max_tokens, row.extent = (
                    prepared.prompt,
                    prepared.max_tokens,
                    prepared.extent,
                )
                row.tokenizer = loaded.tokenizer
                row.text = TextStream(loaded.tokenizer.detokenizer, row.request.stop)
                row.output = make_output(loaded, row.request, prepared.phase)
                row.matcher = prepared.constraint
                row.prefetched = None
        if not loaded.capabilities.batchable:
            while self.pending:
                row = self.pending.popleft()
                row.lane, row.reason = "serial", "capability"
                self.serial_queue.append(row)

    def _refuse(self, channel: Channel, failed: Failed) -> None:
        self.counters.reject(failed.code)
        channel.push(failed)

    def _retry_after(self, depth: int) -> int:
        """Seconds until the queue has likely moved: its tokens over the observed rate."""
        rate = self.throughput.view(time.time())["last_minute_tps"]
        if rate <= 0:
            return max(1, min(300, depth))
        return max(1, min(300, math.ceil(depth * self.avg_generated / rate)))

    # ------------------------------------------------------------ cancel

    def cancel(self, request_id: str) -> None:
        """Remove a request wherever it is; a running row leaves before the next step."""
        for queue in (self.pending, self.serial_queue):
            for row in queue:
                if row.id == request_id:
                    queue.remove(row)
                    self._cancelled(row)
                    return
        if self.serial is not None and self.serial.row.id == request_id:
            self.serial.row.cancelled = True
            return
        if self.batch is not None:
            for row in list(self.batch.rows.values()):
                if row.id == request_id:
                    self.batch.remove([row])
                    self._cancelled(row)
                    return

    def _cancelled(self, row: Row) -> None:
        row.cancelled = True
        self.counters.outcome(row.lane, "cancelled")
        row.fail(Failed("cancelled", "the request was cancelled", 499))

    # ------------------------------------------------------------ tick

    def tick(self) -> bool:
        """Plan the lanes, admit, run one step. Returns True if a step ran."""
        if self.loaded is None and not self.exclusive:
            return False
        self._plan_and_start()
        if self.serial is not None:
            self._step_serial()
        elif self.batch is not None and len(self.batch):
            self._step_batch()
        else:
            return False
        if self.drains.open is not None and self.serial is None:
            # A serial request just ended: admission may resume now, not next tick.
            self._plan_and_start()
        return True

    @property
    def busy(self) -> bool:
        return bool(
            self.pending
            or self.serial_queue
            or self.serial
            or self.exclusive
            or (self.batch is not None and len(self.batch))
        )

    def _plan_and_start(self) -> None:
        running = len(self.batch) if self.batch is not None else 0
        p = plan(
            LaneState(
                batch_running=running,
                batch_pending=len(self.pending),
                serial_waiting=len(self.serial_queue),
                serial_running=self.serial is not None,
                exclusive_waiting=bool(self.exclusive),
                last_turn=self.last_turn,  # type: ignore[arg-type]
            )
        )
        now, wall = time.monotonic(), time.time()
        if p.draining and self.drains.open is None:
            if self.exclusive:
                reason, request_id = self.exclusive[0][0], None
            else:
                reason, request_id = self.serial_queue[0].reason, self.serial_queue[0].id
            self.drains.start(reason, request_id, running, wall=wall, mono=now)
        if p.run_exclusive:
            _, call = self.exclusive.popleft()
            self.drains.waiter_started(mono=now)
            call()
        if p.start_serial:
            self.drains.waiter_started(mono=now)
            self._start_serial(self.serial_queue.popleft())
        if p.admit_batch:
            self.drains.end(wall=wall, mono=now)
            self._admit()
        else:
            self.waiting_for = p.batch_blocked_by

    # ------------------------------------------------------------ prompt cache

    def _live_bytes(self) -> int:
        return self.batch.nbytes if self.batch is not None else 0

    def _fetch_cache(self, prompt: list[int]) -> tuple[list[Any] | None, list[int]]:
        if self.loaded is None:
            return None, prompt
        return self.prompt_cache.fetch(self.loaded.key, prompt)

    def _cache_store(self, tokens: list[int] | None, cache: list[Any] | None) -> None:
        if self.loaded is not None:
            self.prompt_cache.store(self.loaded.key, tokens, cache, self._live_bytes())

    # ------------------------------------------------------------ batch lane

    def _admit(self) -> None:
        assert self.loaded is not None
        self.waiting_for = None
        if not self.pending:
            return
        if self.batch is None:
            self.batch = self.batch_factory(self.loaded, self.settings.batch, faults=self.faults)
        batch, layout = self.batch, self.loaded.layout
        step = self.settings.batch.prefill_step_size
        pool = self.pool
        while self.pending:
            row = self.pending[0]
            if row.prefetched is None:
                row.prefetched = self._fetch_cache(row.prompt)
            cache, rest = row.prefetched
            row.extent = replace(row.extent, cached=len(row.prompt) - len(rest))
            check = admission.check_admission(
                layout,
                [r.extent for r in batch.rows.values()],
                row.extent,
                batch_size=self.settings.batch.size,
                budget=self._admission_budget(),
                real_bytes=batch.nbytes,
                prefill_step_size=step,
            )
            if not check.admit:
                self.waiting_for = check.waiting_for
                return
            if pool is not None and not pool.claim_kv(
                self.pool_id, self._kv_claim(max(check.projected_bytes, batch.nbytes))
            ):
                self.waiting_for = "budget"  # another model claimed it in the meantime
                return
            self.pending.popleft()
            row.prefetched = None
            row.admitted(len(row.prompt) - len(rest))
            try:
                batch.insert(row, cache, rest)
            except Exception as exc:
                logger.exception("inserting %s into the batch", row.id)
                self._fail(row, f"could not start generation: {exc}")
                continue
            self.last_turn = "batch"
            self.max_active_seen = max(self.max_active_seen, len(batch))
            self.prompt_cache.trim(self._live_bytes())

    def _admission_budget(self) -> int:
        """The KV bytes the batch may use now: the budget, less what other models claim."""
        if self.pool is None:
            return self.budget_bytes
        serial = self.serial.nbytes if self.serial is not None else 0
        return min(self.budget_bytes, self.pool.kv_limit(self.pool_id) - serial)

    def _step_batch(self) -> None:
        batch = self.batch
        assert batch is not None
        try:
            with batch.stats() as stats:
                outs = batch.step()
        except Exception as exc:
            self._batch_failed(exc)
            return
        self.counters.prefill_seconds += stats.prompt_time
        self.counters.decode_seconds += stats.decode_time
        self.last_step_wall = time.time()
        early: list[Row] = []
        for out in outs:
            row = out.row
            if row.error is None:
                try:
                    is_eos = out.finish_reason == "stop"
                    stopped = row.push_token(out.token, out.logprobs, is_eos=is_eos)
                except Exception as exc:  # a detokenizer failing for this row alone
                    row.error = exc
                    stopped = False
            if row.error is not None:
                if out.finish_reason is None:
                    early.append(row)
                else:
                    self._fail(row, f"generation failed for this request: {row.error}")
                continue
            if out.finish_reason is not None:
                self._complete(row, "stop" if out.finish_reason == "stop" else "length")
                self._cache_store(out.all_tokens, out.cache)
            elif stopped:
                early.append(row)
        self.throughput.add(len(outs), time.time())
        if early:
            caches = batch.remove(early, return_caches=True)
            for row in early:
                if row.error is not None:
                    self._fail(row, f"generation failed for this request: {row.error}")
                    continue
                self._complete(row, "stop", stopped_by_string=True)
                cache, tokens = caches.get(row.uid, (None, None))
                self._cache_store(tokens, cache)
        # Rows whose processor failed this step may not have produced a token.
        failed = [r for r in batch.rows.values() if r.error is not None]
        if failed:
            batch.remove(failed)
            for row in failed:
                self._fail(row, f"generation failed for this request: {row.error}")
        self.max_kv_seen = max(self.max_kv_seen, batch.nbytes)

    def _batch_failed(self, exc: Exception) -> None:
        logger.exception("the batched step failed; failing its rows and rebuilding the batch")
        self.counters.engine_errors += 1
        self.note_error(f"batched step failed: {exc!r}")
        assert self.batch is not None
        for row in self.batch.reset(self.settings.batch):
            self._fail(row, f"the batched forward failed ({exc}); the engine recovered")

    # ------------------------------------------------------------ serial lane

    def _start_serial(self, row: Row) -> None:
        assert self.loaded is not None
        cache, rest = self._fetch_cache(row.prompt)
        row.admitted(len(row.prompt) - len(rest))
        self.last_turn = "serial"
        try:
            self.serial = self.serial_factory(
                self.loaded,
                row,
                cache,
                rest,
                prefill_step_size=self.settings.batch.prefill_step_size,
                pump=self.pump,
                faults=self.faults,
            )
        except Exception as exc:
            logger.exception("starting %s", row.id)
            self._fail(row, f"could not start generation: {exc}")

    def _step_serial(self) -> None:
        run = self.serial
        assert run is not None and self.loaded is not None
        step = run.step(self.loaded.tokenizer.eos_token_ids)
        if step.prefill:
            self.counters.prefill_seconds += step.seconds
        else:
            self.counters.decode_seconds += step.seconds
        self.last_step_wall = time.time()
        if step.token:
            self.throughput.add(1, time.time())
        if step.ended is None:
            self.max_kv_seen = max(self.max_kv_seen, run.nbytes)
            return
        self.serial = None
        row = run.row
        if step.ended == "cancelled":
            self._cancelled(row)
        elif step.ended == "failed":
            self.counters.engine_errors += step.engine_error
            self._fail(row, step.error or "generation failed")
        else:
            self._complete(row, step.ended, stopped_by_string=step.stopped_by_string)
            self._cache_store(row.prompt + row.generated_ids, run.cache)

    # ------------------------------------------------------------ endings

    def _complete(self, row: Row, reason: str, *, stopped_by_string: bool = False) -> None:
        row.finish(reason, stopped_by_string=stopped_by_string)  # type: ignore[arg-type]
        c = self.counters
        c.outcome(row.lane, "completed")
        c.prompt_tokens += len(row.prompt)
        c.generated_tokens += row.generated
        c.cached_tokens += row.cached_tokens
        c.tool_calls += row.output.calls
        c.tool_call_parse_failures += row.output.failed_calls
        self.avg_generated = 0.9 * self.avg_generated + 0.1 * row.generated

    def _fail(
        self, row: Row, message: str, *, code: str = "generation_error", status: int = 500
    ) -> None:
        self.counters.outcome(row.lane, "failed")
        row.fail(Failed(code, message, status))  # type: ignore[arg-type]

    def abort_all(self, message: str, *, code: str = "shutting_down", status: int = 503) -> None:
        """End every request, queued or running, with an error (shutdown, fatal errors)."""
        if self.serial is not None:
            self.serial.close()
            self._fail(self.serial.row, message, code=code, status=status)
            self.serial = None
        if self.batch is not None:
            for row in self.batch.reset(self.settings.batch):
                self._fail(row, message, code=code, status=status)
        for queue in (self.pending, self.serial_queue):
            while queue:
                self._fail(queue.popleft(), message, code=code, status=status)

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
        self.loaded = None
        self.prompt_cache.clear()
