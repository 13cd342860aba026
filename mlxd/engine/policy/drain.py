"""Drain: how the batched and serial lanes take turns, and the record of it.

``plan`` is pure: the state of both lanes goes in, what the engine may do
this iteration comes out. :class:`DrainLog` turns those iterations into drain
events (start, end, why, rows at start, waits) in a bounded ring buffer.

The rules (docs/batching.md, "Drain"):

1. A serial request waiting while batch rows run stops batch admission; the
   running rows finish, then the serial request runs. It never waits for more
   than the rows that were running.
2. After a serial request, if batch requests are pending, the batch gets a
   turn before the next serial request, so an endless serial stream cannot
   starve the batch (the lanes alternate when both are busy).
3. An exclusive call (a model swap) waits for both lanes to be idle, and
   nothing new starts meanwhile.
4. Priority (docs/batching.md, "Priority and fair share"): a batch request
   more urgent than the serial waiter (``batch_outranks``) is admitted
   instead of draining for the waiter, and goes first when both lanes are
   idle; the waiter's own turn comes once nothing more urgent waits, or once
   aging has lifted it to the batch head's class, so it never starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

Turn = Literal["batch", "serial"]


@dataclass(frozen=True)
class LaneState:
    batch_running: int
    batch_pending: int
    serial_waiting: int
    serial_running: bool
    exclusive_waiting: bool
    last_turn: Turn
    # The head of the batch queue is more urgent than the head of the serial queue.
    batch_outranks: bool = False


@dataclass(frozen=True)
class Plan:
    admit_batch: bool
    start_serial: bool
    run_exclusive: bool
    # Why pending batch rows cannot be admitted this iteration, if they cannot.
    batch_blocked_by: Literal["drain", "serial_lane"] | None
    draining: bool


def plan(state: LaneState) -> Plan:
    """Decide what may start this iteration; see the module docstring."""
    idle = state.batch_running == 0 and not state.serial_running
    if state.exclusive_waiting:
        return Plan(False, False, idle, "drain", state.batch_running > 0 or state.serial_running)
    if state.serial_running:
        return Plan(False, False, False, "serial_lane", False)
    if state.serial_waiting:
        if state.batch_outranks and state.batch_pending > 0:
            return Plan(True, False, False, None, False)
        if state.batch_running > 0:
            return Plan(False, False, False, "drain", True)
        if state.last_turn == "serial" and state.batch_pending > 0:
            return Plan(True, False, False, None, False)
        return Plan(False, True, False, "serial_lane", False)
    return Plan(True, False, False, None, False)


@dataclass(frozen=True)
class DrainEvent:
    """One drain. Times are wall-clock epoch seconds; ``None`` while open."""

    id: int
    reason: str
    request_id: str | None
    started_at: float
    rows_at_start: int
    ended_at: float | None = None
    serial_wait_s: float | None = None
    paused_s: float | None = None


class DrainLog:
    """Tracks the open drain, if any, and keeps the last ``size`` events."""

    def __init__(self, size: int = 64):
        self._events: deque[DrainEvent] = deque(maxlen=size)
        self._open: DrainEvent | None = None
        self._started_mono = 0.0
        self._next_id = 1
        self.total = 0
        self.total_paused_s = 0.0

    @property
    def open(self) -> DrainEvent | None:
        return self._open

    def start(
        self, reason: str, request_id: str | None, rows: int, *, wall: float, mono: float
    ) -> None:
        """A drain begins: admission stops because ``request_id`` needs the lanes."""
        if self._open is not None:
            return
        self._open = DrainEvent(self._next_id, reason, request_id, wall, rows)
        self._started_mono = mono
        self._next_id += 1
        self.total += 1

    def waiter_started(self, *, mono: float) -> None:
        """The request that caused the drain got the engine."""
        if self._open is not None and self._open.serial_wait_s is None:
            self._open = replace(self._open, serial_wait_s=mono - self._started_mono)

    def end(self, *, wall: float, mono: float) -> DrainEvent | None:
        """Admission resumes; the event is closed and kept."""
        event = self._open
        if event is None:
            return None
        paused = mono - self._started_mono
        wait = event.serial_wait_s if event.serial_wait_s is not None else paused
        closed = replace(event, ended_at=wall, serial_wait_s=wait, paused_s=paused)
        self._events.append(closed)
        self._open = None
        self.total_paused_s += paused
        return closed

    def events(self) -> tuple[DrainEvent, ...]:
        """Closed events, newest first, then the open one (if any) on top."""
        newest_first = tuple(reversed(self._events))
        return ((self._open,) if self._open else ()) + newest_first
