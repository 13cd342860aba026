"""An engine start that does not finish in time fails visibly instead of hanging quietly.

Starting a chat engine loads its model and opens its prompt cache's disk
tier on the engine thread; while it runs, requests queue and ``/ready``
says "starting". A start stuck on something outside mlxd (a hung network
mount, a device file) would leave both that way forever. After ``[server]
engine_start_timeout`` seconds :class:`StartDeadline` calls its ``overdue``
callback with a :class:`~mlxd.engine.messages.Failed` (503
``model_load_failed``, saying so): the engine fails every queued request
with it, shows it as its state and load error (so ``/ready`` says why), and
refuses new requests and commands at once, until its start finishes after
all (:meth:`StartDeadline.failure` is then None again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mlxd.engine.messages import Failed

logger = logging.getLogger(__name__)


class StartDeadline:
    """Watches one engine's start (a timer thread); see the module docstring.

    Args:
        seconds: ``[server] engine_start_timeout``; 0 watches nothing.
        started: Set by the engine once its start finished (loaded or failed).
        ready: Whether the engine has finished starting after all.
    """

    def __init__(self, seconds: float, started: threading.Event, ready: Callable[[], bool]):
        self.seconds = seconds
        self._started = started
        self._ready = ready
        self._failure: Failed | None = None
        self._timer: threading.Timer | None = None

    def arm(self, overdue: Callable[[Failed], None]) -> None:
        """Start the clock; ``overdue`` runs on the timer's thread if the start is late."""
        if self.seconds <= 0:
            return

        def fire() -> None:
            if self._started.is_set():
                return
            failed = Failed(
                "model_load_failed",
                f"the engine did not finish starting (loading the model, opening its prompt "
                f"cache) within [server] engine_start_timeout = {self.seconds:g} s; requests "
                "are refused until it does",
                503,
            )
            logger.error("%s", failed.message)
            self._failure = failed
            overdue(failed)

        self._timer = threading.Timer(self.seconds, fire)
        self._timer.name, self._timer.daemon = "mlxd-start-deadline", True
        self._timer.start()

    @property
    def failure(self) -> Failed | None:
        """The refusal while the start is overdue; None before, and once it finished."""
        if self._failure is not None and self._ready():
            logger.warning("the engine finished starting after its deadline; serving now")
            self._failure = None
        return self._failure

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
