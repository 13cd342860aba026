"""How a cluster rank notices that the others are gone, and leaves: one rule for every rank.

Collectives have no timeout of their own (docs/cluster.md, "When something
fails"), so every rank runs a :class:`Watchdog` over its waits on the others:
rank 0 over each plan it broadcasts and the step that follows, a follower
over the wait for rank 0's next plan. An idle rank 0 sends an empty plan at
least every :data:`HEARTBEAT_S`, so a follower never waits long in a healthy
cluster. A wait longer than ``step_timeout``, a wait of more than
:data:`PROBE_AFTER_S` on a peer whose connection is closed (:mod:`.links`:
MLX's ring does not always raise when a peer dies), a failed collective or
a digest mismatch ends the process through :func:`leave` (rank 0:
:func:`leave_soon`) with :data:`EXIT_LOST`, so a supervisor restarts the
whole group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from mlxd.process import exit_now

logger = logging.getLogger(__name__)

# An idle rank 0 broadcasts an empty plan at least this often (seconds).
HEARTBEAT_S = 0.1
# A wait this long (seconds) has the links probed for a peer that closed them.
PROBE_AFTER_S = 0.5
# How often the watch looks at the wait under way (seconds, at most).
POLL_S = 0.25
# The exit status of a rank that lost the cluster (a peer died, hung or diverged).
EXIT_LOST = 3


class Watchdog:
    """Calls ``on_timeout`` once when a wait on the other ranks outlasts ``timeout``,
    or sooner when ``probe`` finds a peer gone.

    The owner arms it when a wait starts and disarms it when the wait ends
    (or before one that may rightly take long, such as loading a shard);
    :meth:`stop` ends the watch for good. The watch runs on its own thread
    because the waiting thread is stuck inside a collective (MLX releases
    the GIL there).

    Args:
        timeout: ``[cluster] step_timeout`` in seconds.
        on_timeout: Called with the reason, on the watchdog's thread.
        waiting: What waited, for the reason ("no plan has come from rank 0").
        culprit: Who is to blame, for the reason ("rank 0").
        probe: Asked during a wait longer than :data:`PROBE_AFTER_S`: why a
            peer is surely gone (:meth:`.links.Links.closed`), or ``None``.
    """

    def __init__(
        self,
        timeout: float,
        on_timeout: Callable[[str], None],
        *,
        waiting: str,
        culprit: str,
        probe: Callable[[], str | None] | None = None,
    ):
        self.timeout = timeout
        self.probe = probe
        self._waiting = waiting
        self._on_timeout = on_timeout
        self._reason = (
            f"{waiting} for more than step_timeout ({timeout:g}s): "
            f"{culprit} is unreachable or stuck"
        )
        self._since: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="mlxd-cluster-watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def arm(self) -> None:
        """A wait on the other ranks starts now (or starts over)."""
        self._since = time.monotonic()

    def disarm(self) -> None:
        """No wait is under way."""
        self._since = None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(POLL_S, self.timeout / 10)):
            why = self._why()
            if why is not None:
                self._stopped.set()
                self._on_timeout(why)
                return

    def _why(self) -> str | None:
        since = self._since
        if since is None:
            return None
        waited = time.monotonic() - since
        if waited > self.timeout:
            return self._reason
        if self.probe is not None and waited > PROBE_AFTER_S:
            gone = self.probe()
            if gone is not None and self._since == since:
                return f"{self._waiting}, but {gone}: the rank exited or its host went down"
        return None


def leave(message: str, code: int = EXIT_LOST) -> NoReturn:
    """The one way a rank leaves a cluster it cannot go on with: log why, exit ``code`` now."""
    _log_leaving(message, code)
    exit_now(code)


def leave_soon(message: str, code: int = EXIT_LOST, *, grace_s: float = 1.0) -> None:
    """:func:`leave`, with the exit ``grace_s`` seconds later from a thread.

    Rank 0 uses it so that the error events of its requests reach their
    clients first; it returns at once.
    """
    _log_leaving(message, code)

    def later() -> None:
        time.sleep(grace_s)
        exit_now(code)

    threading.Thread(target=later, name="mlxd-exit", daemon=True).start()


def _log_leaving(message: str, code: int) -> None:
    logger.error("cluster lost (%s); exiting with status %d", message, code)
