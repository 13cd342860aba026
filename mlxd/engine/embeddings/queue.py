"""What waits for an embedding model's thread: requests by stage and commands, under one lock.

Callers, the two intake threads and the model's thread of one
:class:`~mlxd.engine.embeddings.engine.EmbeddingEngine` share one
:class:`WorkQueue`. Each method takes its lock, so a request is always in
exactly one stage: waiting (a load or an unload is under way), intaking
(being checked and tokenized), or prepared (in the inbox, for the model's
thread). The queue also decides what a new request gets (wait, tokenize, or
a refusal) from the engine's state, and counts what the snapshot shows.
Nothing here touches MLX.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from mlxd.config import Settings
from mlxd.engine.embeddings.jobs import Job, shutting_down
from mlxd.engine.embeddings.messages import (
    EmbeddingInfo,
    EmbeddingResult,
    EmbeddingSnapshot,
    EmbeddingState,
)
from mlxd.engine.messages import Failed


@dataclass(frozen=True)
class Load:
    """Load ``settings.model`` (the old model, if any, serves until it is loaded)."""

    settings: Settings
    future: Future[EmbeddingInfo]


@dataclass(frozen=True)
class Unload:
    """Drop the model; the thread stays for the next :class:`Load`."""

    future: Future[None]


@dataclass(frozen=True)
class Apply:
    """New live settings (the batch size), used from the next round on."""

    settings: Settings
    future: Future[None]


Command = Load | Unload | Apply
# What the model's thread is given next: a command, a round of requests, or None to stop.
Work = Command | list[Job] | None


@dataclass
class _Counters:
    served: int = 0
    failed: int = 0
    inputs: int = 0
    tokens: int = 0
    passes: int = 0
    last_batch: int = 0
    running: int = 0


class WorkQueue:
    """The requests and commands of one embedding engine (see the module docstring)."""

    def __init__(self, model_id: str, state: EmbeddingState, batch_limit: int):
        self._cond = threading.Condition()
        self._model_id = model_id
        self._state: EmbeddingState = state
        self._load_error: str | None = None
        self._weights_bytes = 0
        self._batch_limit = batch_limit
        self._stopping = False
        self._waiting: list[Job] = []  # while a load or an unload is under way
        self._intaking: set[Job] = set()  # on an intake thread
        self._inbox: deque[Job] = deque()  # prepared, for the model's thread
        self._commands: deque[Command] = deque()
        self._carrying = False  # the model's thread is loading or unloading
        self._counts = _Counters()

    # ------------------------------------------------------------ callers

    def admit(self, job: Job) -> Literal["wait", "intake"] | Failed:
        """Where a new request goes: it waits for a load, it is tokenized now, or it is refused."""
        with self._cond:
            if self._stopping or self._state == "stopped":
                return shutting_down()
            if self._state == "loading" or self._draining():
                self._waiting.append(job)
                return "wait"
            refusal = self._refusal()
            if refusal is not None:
                return refusal
            self._intaking.add(job)
            return "intake"

    def command(self, command: Command) -> bool:
        """Queue ``command`` for the model's thread; False once the engine is stopping."""
        with self._cond:
            if self._stopping:
                return False
            self._commands.append(command)
            self._cond.notify()
            return True

    def rename(self, model_id: str) -> None:
        with self._cond:
            self._model_id = model_id

    @property
    def model_id(self) -> str:
        with self._cond:
            return self._model_id

    @property
    def busy(self) -> bool:
        """Requests waiting, being tokenized or being embedded."""
        with self._cond:
            return bool(self._waiting or self._intaking or self._inbox or self._counts.running)

    @property
    def state(self) -> EmbeddingState:
        with self._cond:
            return self._state

    @property
    def load_error(self) -> str | None:
        with self._cond:
            return self._load_error

    def stop(self) -> tuple[list[Job], list[Command]]:
        """Stop taking work; returns every queued request and command, for the caller to fail."""
        with self._cond:
            self._stopping = True
            jobs = [*self._waiting, *self._intaking, *self._inbox]
            self._waiting.clear()
            self._intaking.clear()
            self._inbox.clear()
            commands = list(self._commands)
            self._commands.clear()
            self._cond.notify_all()
        return jobs, commands

    def snapshot(self) -> EmbeddingSnapshot:
        with self._cond:
            c = self._counts
            return EmbeddingSnapshot(
                id=self._model_id,
                state=self._state,
                queued=len(self._waiting) + len(self._intaking) + len(self._inbox),
                running=c.running,
                requests_served=c.served,
                requests_failed=c.failed,
                inputs_embedded=c.inputs,
                tokens_embedded=c.tokens,
                last_batch_size=c.last_batch,
                batch_limit=self._batch_limit,
                forward_passes=c.passes,
                weights_bytes=self._weights_bytes,
                load_error=self._load_error,
            )

    # ------------------------------------------------------------ intake threads

    def prepared(self, job: Job, *, notify: bool = True) -> Failed | None:
        """``job`` left its intake thread: into the inbox, unless it failed or the engine stops."""
        with self._cond:
            self._intaking.discard(job)
            if job.future.done():
                refusal = None
            elif self._stopping:
                refusal = shutting_down()
            else:
                refusal = None
                self._inbox.append(job)
            if notify:  # the model's thread waits for new work, or for intake to empty
                self._cond.notify()
            return refusal

    # ------------------------------------------------------------ the model's thread

    def next(self, limit: int) -> Work:
        """Wait for work: a command first (a load or an unload once no request is in
        intake or the inbox), else prepared requests in order until the round holds
        ``limit`` inputs (at least one request). None when the engine stops."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                command = self._next_command()
                if command is not None:
                    return command
                if self._inbox and self._state == "ready":
                    return self._round(limit)
                self._cond.wait()

    def settle(
        self,
        state: EmbeddingState,
        *,
        load_error: str | None = None,
        weights_bytes: int | None = None,
        batch_limit: int | None = None,
        loaded: bool = False,
    ) -> list[Job]:
        """A load or an unload ended (or the thread did): publish the model's state.

        ``loaded``: a new model serves, so the counts start again (they are
        "since load"). Returns the requests that waited, unless another load
        or unload is queued: in intake already when the model is ready (the
        caller prepares them), to be refused otherwise (see :meth:`refusal`).
        """
        with self._cond:
            if loaded:
                self._counts = _Counters()
            self._state = state
            self._carrying = False
            self._load_error = load_error
            if weights_bytes is not None:
                self._weights_bytes = weights_bytes
            if batch_limit is not None:
                self._batch_limit = batch_limit
            if self._draining():
                return []
            waiting, self._waiting = self._waiting, []
            if state == "ready" and not self._stopping:
                self._intaking.update(waiting)
            return waiting

    def refusal(self) -> Failed:
        """Why a request that waited cannot be served now (after a failed load or an unload)."""
        with self._cond:
            return self._refusal() or shutting_down()

    def set_batch_limit(self, limit: int) -> None:
        with self._cond:
            self._batch_limit = limit

    @property
    def stopping(self) -> bool:
        with self._cond:
            return self._stopping

    def inbox_empty(self) -> bool:
        with self._cond:
            return not self._inbox

    # ------------------------------------------------------------ counts

    def count_pass(self, inputs: int) -> None:
        with self._cond:
            self._counts.passes += 1
            self._counts.last_batch = inputs

    def count_served(self, inputs: int, result: EmbeddingResult) -> None:
        with self._cond:
            self._counts.served += 1
            self._counts.inputs += inputs
            self._counts.tokens += result.prompt_tokens

    def count_failed(self) -> None:
        with self._cond:
            self._counts.failed += 1

    def round_ended(self) -> None:
        with self._cond:
            self._counts.running = 0

    # ------------------------------------------------------------ under the lock

    def _draining(self) -> bool:
        """A load or an unload is under way, or waits for the requests before it."""
        return self._carrying or any(not isinstance(c, Apply) for c in self._commands)

    def _next_command(self) -> Command | None:
        if not self._commands:
            return None
        first = self._commands[0]
        if isinstance(first, Apply):
            return self._commands.popleft()
        if self._intaking or self._inbox:
            return None
        self._carrying = True
        if isinstance(first, Load):
            self._state = "loading"
        return self._commands.popleft()

    def _round(self, limit: int) -> list[Job]:
        jobs = [self._inbox.popleft()]
        count = jobs[0].width
        while self._inbox and count + self._inbox[0].width <= limit:
            count += self._inbox[0].width
            jobs.append(self._inbox.popleft())
        self._counts.running = len(jobs)
        return jobs

    def _refusal(self) -> Failed | None:
        if self._stopping or self._state == "stopped":
            return shutting_down()
        if self._state == "failed":
            return Failed(
                "model_load_failed",
                f"The embedding model '{self._model_id}' failed to load: {self._load_error}",
                503,
            )
        if self._state == "unloaded":
            return Failed(
                "model_not_loaded", f"The embedding model '{self._model_id}' is not loaded.", 503
            )
        return None
