"""The engine thread: its inbox, the intake thread it feeds, and the snapshot it publishes.

One thread owns the model and every MLX object (house rule 2). Its loop
takes everything in the inbox (requests, cancels, requests back from the
intake thread, commands; :mod:`mlxd.engine.chat.commands`), runs one step
(:func:`mlxd.engine.chat.step.tick`) and publishes a new snapshot. Commands
are carried out here, between two steps; the two that replace the model
wait, as exclusive work, until both lanes are idle.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import queue
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

from mlxd.config import Settings
from mlxd.engine.channel import Channel
from mlxd.engine.chat.commands import (
    AbortAll,
    Apply,
    Cancel,
    ClearError,
    Command,
    CountTokens,
    Load,
    Order,
    Rename,
    StopAccepting,
    Submit,
    Unload,
    drain_reason,
)
from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.enqueue import enqueue
from mlxd.engine.chat.hooks import ClusterHooks
from mlxd.engine.chat.intake_thread import Intaken, IntakeThread
from mlxd.engine.chat.served_model import ServedModel
from mlxd.engine.chat.snapshots import build_snapshot
from mlxd.engine.chat.step import tick
from mlxd.engine.memory import MemoryPool
from mlxd.engine.messages import Failed

logger = logging.getLogger(__name__)

Message = Submit | Cancel | Intaken | Order

_IDLE_WAIT_S = 0.5
# Busy but no step ran (requests wait for memory another model holds, or for
# intake): look again this often rather than spin.
_WAITING_S = 0.02
# Woken from idle by a request, the engine keeps taking requests until the
# inbox has been quiet this long (at most _BURST_MAX_S), so a burst of clients
# is admitted and prefilled as one group instead of 1 + the rest
# (benchmarks/README.md, "Where the time goes": 5-8% at 8-16 clients).
_BURST_QUIET_S = 0.003
_BURST_MAX_S = 0.020
# What a request gets once the engine thread has died outside its loop.
_DEAD = Failed("generation_error", "the engine thread has stopped", 500)


class EngineThread:
    """The thread that owns one chat model; :class:`~mlxd.engine.chat.engine.Engine` is its face.

    Args:
        settings: The initial settings; the model section says what to load.
        name: The suffix of the threads' names (the model id, or empty).
        hooks: What the engine runs on (one machine, or rank 0 of a cluster).
        pool: The memory budget shared with the other loaded models.
        pool_id: This engine's name in ``pool``.
        optimized_blas: Whether an optimized CPU BLAS is active.
        faults: Honour ``GenerationRequest.fault`` (tests only).
        runtime: Facts about the process for the snapshot.
        load_at_start: Load the model when the thread starts; otherwise wait,
            unloaded, for a :class:`~mlxd.engine.chat.commands.Load`.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        hooks: ClusterHooks,
        pool: MemoryPool | None,
        pool_id: str,
        optimized_blas: bool,
        faults: bool,
        runtime: dict[str, Any] | None,
        load_at_start: bool,
    ):
        self.core = EngineCore(
            settings,
            hooks=hooks,
            pump=self._pump,
            pool=pool,
            pool_id=pool_id,
            faults=faults,
            runtime=runtime,
        )
        self.model = ServedModel(self.core, optimized_blas=optimized_blas, publish=self._publish)
        self._hooks = hooks
        self._optimized_blas = optimized_blas
        self._load_at_start = load_at_start
        self._idle_wait = min(_IDLE_WAIT_S, hooks.heartbeat_s)
        self._inbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._deferred: list[Order] = []
        self._stop = threading.Event()
        # Set once the first load has finished (successfully or not).
        self.loaded = threading.Event()
        suffix = f"-{name}" if name else ""
        self._thread = threading.Thread(target=self._run, name=f"mlxd-engine{suffix}", daemon=True)
        # Requests handed to the intake thread, by id (engine thread only).
        self._intaking: dict[str, Submit] = {}
        self._cancelled_in_intake: set[str] = set()
        self._intake = IntakeThread(f"mlxd-intake{suffix}", self._inbox.put)
        # Every request's channel, to end them from any thread when the engine halts.
        self._channels: weakref.WeakValueDictionary[str, Channel] = weakref.WeakValueDictionary()
        self._channels_lock = threading.Lock()
        # The latest snapshot; replaced, never changed, so readers need no lock.
        self.snapshot = build_snapshot(self.core, state="starting")

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._intake.start()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, submit: Submit) -> None:
        """Queue a new request (see :meth:`halt` for why its channel is kept)."""
        if not self.alive and self._thread.ident is not None:
            submit.channel.push(_DEAD)
            return
        with self._channels_lock:
            self._channels[submit.request.id] = submit.channel
        self._inbox.put(submit)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(Cancel(request_id))

    def send(self, command: Command) -> concurrent.futures.Future[Any]:
        """Have the engine thread carry out ``command``; the future resolves when it has."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if not self.alive and self._thread.ident is not None:
            future.set_exception(RuntimeError("the engine thread is not running"))
            return future
        self._inbox.put(Order(command, future))
        return future

    def halt(self, failed: Failed) -> None:
        """The engine cannot go on: end every request with ``failed``, show its code as the state.

        Runs on the engine thread (a collective raised) or on another (a
        cluster's watchdog, while the engine thread is stuck in a
        collective), so off the engine thread it touches only channels and
        the snapshot reference.
        """
        if threading.current_thread() is self._thread:
            self.core.abort_all(failed.message, code=failed.code, status=failed.status)
            self._publish(state=failed.code)
        else:
            self.snapshot = replace(self.snapshot, state=failed.code, cluster=self._hooks.status())
        with self._channels_lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.push(failed)
        for submit in list(self._intaking.values()):
            submit.channel.push(failed)

    def stop(self, timeout: float) -> bool:
        """End every request, stop both threads; True once the engine thread has exited."""
        self._stop.set()
        self._inbox.put(None)
        self._intake.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._hooks.run(self._serve, self.halt)
        except Exception as exc:  # outside the loop (starting, loading): the engine is gone
            logger.exception("the engine thread failed")
            self.core.note_error(f"engine thread failed: {exc!r}")
            self.halt(replace(_DEAD, message=f"{_DEAD.message}: {exc}"))

    def _serve(self) -> None:
        core = self.core
        self._publish(state="starting")
        self._hooks.join(core.settings, optimized_blas=self._optimized_blas)
        self._publish(state="starting")
        self._load_first()
        stepped = True
        while not self._stop.is_set():
            try:
                if not core.busy:
                    self._drain_inbox(block=True)
                else:
                    self._drain_inbox(block=not stepped, wait=_WAITING_S)
                if self._stop.is_set():
                    break
                stepped = tick(core)
                if not stepped:
                    self._hooks.idle()
            except Exception as exc:  # the loop must never die silently
                logger.exception("engine loop error; failing in-flight requests and continuing")
                core.counters.engine_errors += 1
                core.note_error(f"engine loop error: {exc!r}")
                core.abort_all(f"internal engine error: {exc}", code="generation_error", status=500)
                time.sleep(0.05)
            self._publish()
        core.abort_all("the engine stopped", code="shutting_down", status=503)
        for submit in self._intaking.values():
            submit.channel.push(Failed("shutting_down", "the engine stopped", 503))
        self._intaking.clear()
        for order in self._deferred:
            order.future.set_exception(RuntimeError("the engine stopped"))
        self._hooks.shutdown()
        self._publish(state="stopped")
        core.release()
        gc.collect()
        if core.pool is not None:  # unloaded to make room: give the freed buffers back
            import mlx.core as mx

            mx.clear_cache()
        logger.info("engine stopped%s", f" ({core.pool_id})" if core.pool_id else "")

    def _load_first(self) -> None:
        core = self.core
        if not self._load_at_start:
            core.model_status = "unloaded"
            self.loaded.set()
            self._publish()
            return
        error = self.model.load_first()
        self.loaded.set()
        self._hooks.first_load_done(error)
        self._publish()

    def _drain_inbox(
        self, *, block: bool, wait: float | None = None, defer_orders: bool = False
    ) -> None:
        """Take every message waiting; ``block``: wait for the first (``wait`` s at most)."""
        timeout = self._idle_wait if wait is None else wait
        try:
            first = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            first = None
        messages: list[Message | None] = [first] if first is not None else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if block and isinstance(first, Submit | Intaken):
            messages += self._burst()
        if not defer_orders and self._deferred:
            messages = [*self._deferred, *messages]
            self._deferred = []
        for message in messages:
            if message is None:
                continue
            if isinstance(message, Submit):
                self._hand_to_intake(message)
            elif isinstance(message, Intaken):
                self._prepared(message)
            elif isinstance(message, Cancel):
                if message.request_id in self._intaking:
                    self._cancelled_in_intake.add(message.request_id)
                else:
                    self.core.cancel(message.request_id)
            elif defer_orders:
                self._deferred.append(message)
            else:
                self._dispatch(message)

    def _burst(self) -> list[Message | None]:
        """The rest of a burst: messages until the inbox is quiet (see _BURST_QUIET_S)."""
        more: list[Message | None] = []
        deadline = time.monotonic() + _BURST_MAX_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                more.append(self._inbox.get(timeout=min(_BURST_QUIET_S, left)))
            except queue.Empty:
                break
        return more

    # ------------------------------------------------------------ intake

    def _hand_to_intake(self, submit: Submit) -> None:
        core = self.core
        if not core.accepting or core.loaded is None:
            enqueue(core, submit.request, submit.channel)  # refused at once, with the reason
            return
        self._intaking[submit.request.id] = submit
        core.intaking = len(self._intaking)
        if core.pool is not None:  # other models may have loaded or unloaded since the last step
            core.scheduler.update_room(core.lanes)
        self._intake.prepare(submit, core.loaded, core.settings, core.scheduler.room)

    def _prepared(self, message: Intaken) -> None:
        core = self.core
        request_id = message.submit.request.id
        self._intaking.pop(request_id, None)
        core.intaking = len(self._intaking)
        if request_id in self._cancelled_in_intake:
            self._cancelled_in_intake.discard(request_id)
            core.counters.reject("cancelled")
            return
        # Tokenized by a model that has been swapped out since: prepare again.
        prepared = message.prepared if message.loaded is core.loaded else None
        enqueue(core, message.submit.request, message.submit.channel, prepared)

    # ------------------------------------------------------------ commands

    def _dispatch(self, order: Order) -> None:
        command, future = order.command, order.future
        if isinstance(command, CountTokens):
            self._count_tokens(command, future)
            return

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self._execute(command))
            except BaseException as exc:
                future.set_exception(exc)
                if not isinstance(exc, Exception):  # a lost cluster ends the thread
                    raise

        reason = drain_reason(command)
        if reason is None:
            run()
        else:
            self.core.scheduler.add_exclusive(reason, run)

    def _execute(self, command: Command) -> Any:
        core = self.core
        match command:
            case Load(model=model, speculative=speculative):
                return self.model.swap(model, speculative)
            case Unload():
                return self.model.unload()
            case Apply(settings=settings):
                return core.apply(settings)
            case StopAccepting():
                core.accepting = False
            case AbortAll(message=message):
                core.abort_all(message)
            case ClearError():
                core.last_error = core.last_error_at = None
            case Rename(model_id=model_id):
                core.pool_id = model_id
            case CountTokens():  # handed to the intake thread by _dispatch
                raise AssertionError("CountTokens is not executed here")
        return None

    def _count_tokens(self, command: CountTokens, future: concurrent.futures.Future[Any]) -> None:
        """Count on the intake thread, with the model that serves now."""
        if not future.set_running_or_notify_cancel():
            return
        loaded = self.core.loaded
        if loaded is None:
            future.set_result(Failed("model_not_loaded", "No model is loaded yet.", 503))
        else:
            self._intake.count(command.request, loaded, future)

    # ------------------------------------------------------------ snapshot

    def _pump(self) -> None:
        """Keep intake, cancels and the snapshot moving during a long serial prefill."""
        self._drain_inbox(block=False, defer_orders=True)
        self._publish()

    def _publish(self, state: str | None = None) -> None:
        core = self.core
        if state is None:
            if not core.accepting:
                state = "stopping"
            elif core.loaded is None:
                status = core.model_status
                state = status if status in ("failed", "unloaded") else "starting"
            else:
                state = "ready"
        core.sample_peaks()
        core.prompt_cache.collect()  # what the disk writer finished since the last step
        hooks = self._hooks
        self.snapshot = build_snapshot(core, state=hooks.state(state), cluster=hooks.status())
