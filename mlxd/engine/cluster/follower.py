"""A cluster rank other than 0: join, then follow rank 0's plans until it says shutdown.

A follower serves no API and makes no decisions. Its engine thread joins
the group, then loops: receive a :class:`~.plan.Plan`, apply its
operations to this rank's :class:`~.replica.Replica` (the same lanes and
prompt cache rank 0 uses, so the caches stay in lockstep), run the planned
step, and compare digests when asked. It exits 0 on rank 0's ``Shutdown``,
and with ``EXIT_LOST`` (:mod:`.watchdog`) when a collective fails, the
digests disagree, or no plan arrives for ``step_timeout`` seconds.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from types import FrameType

from mlxd.config import Settings
from mlxd.engine.cluster.join import ClusterError, Membership, join
from mlxd.engine.cluster.links import Links
from mlxd.engine.cluster.plan import (
    Collectives,
    Load,
    Plan,
    Shutdown,
    compare_digests,
    decode_plan,
    is_collective_error,
    local_digest,
)
from mlxd.engine.cluster.replica import Replica
from mlxd.engine.cluster.rows import Desync
from mlxd.engine.cluster.watchdog import EXIT_LOST, Watchdog, leave
from mlxd.process import EXIT_REFUSED, exit_now

logger = logging.getLogger(__name__)

# After SIGTERM, how long a follower waits for rank 0's shutdown plan.
_TERM_WAIT_S = 30.0


class Follower:
    """One follower rank; :meth:`run` is its engine thread's body."""

    def __init__(
        self, settings: Settings, member: Membership, *, optimized_blas: bool, faults: bool
    ):
        assert settings.cluster is not None
        self.settings = settings.cluster
        self.batch_settings = settings.batch
        self.member = member
        self.optimized_blas = optimized_blas
        self.faults = faults
        self.stopping = threading.Event()
        # Why this rank lost the cluster, when :meth:`run` returned EXIT_LOST.
        self.lost: str | None = None
        # Rank 0 plans every step and sends an empty plan every HEARTBEAT_S when idle.
        self.links = Links()
        self.watchdog = Watchdog(
            self.settings.step_timeout,
            leave,
            waiting="no plan has come from rank 0",
            culprit="rank 0",
            probe=self.links.closed,
        )

    def run(self) -> int:
        """Join, then apply plans until rank 0 says shutdown. Returns the exit code.

        0 after rank 0's shutdown; ``EXIT_REFUSED`` when the cluster could
        not form; ``EXIT_LOST`` when this rank lost it (:attr:`lost` says why).
        """
        replica: Replica | None = None
        try:
            col = self._join()
            replica = Replica(
                col, self.batch_settings, optimized_blas=self.optimized_blas, faults=self.faults
            )
            self.watchdog.arm()
            self.watchdog.start()
            while True:
                data = col.broadcast(None)
                self.watchdog.arm()
                if not data:
                    raise Desync("received an empty plan")
                if self._apply(decode_plan(data), col, replica):
                    logger.info("rank 0 shut the cluster down; exiting")
                    return 0
        except ClusterError as exc:
            logger.error("%s", exc)
            return EXIT_REFUSED
        except Desync as exc:
            self.lost = f"this rank fell out of step with rank 0: {exc}"
        except Exception as exc:
            if is_collective_error(exc):
                self.lost = f"rank 0 or a peer was lost: {exc}"
            else:
                logger.exception("cluster follower failed")
                self.lost = f"the cluster follower failed: {exc!r}"
        finally:
            self.watchdog.stop()
            if replica is not None:
                replica.release()
        return EXIT_LOST

    def _join(self) -> Collectives:
        col = Collectives(join(self.member, self.settings.join_timeout))
        self.links.find(self.member.endpoints, col.rank)
        hosts = col.gather_text(socket.gethostname())
        logger.info(
            "rank %d of %d joined (%s); waiting for rank 0's plans",
            col.rank,
            col.size,
            ", ".join(hosts),
        )
        return col

    def _apply(self, plan: Plan, col: Collectives, replica: Replica) -> bool:
        """Apply ``plan`` and run its step; True when it was rank 0's last."""
        for op in plan.ops:
            if isinstance(op, Load):
                # Loading a big shard may take longer than a step.
                self.watchdog.disarm()
                try:
                    replica.apply(op)
                finally:
                    self.watchdog.arm()
            else:
                replica.apply(op)
        replica.plan_done()
        if plan.run == "batch":
            replica.step_batch()
        elif plan.run == "serial":
            replica.step_serial()
        if plan.digest:
            why = compare_digests(col.gather_digests(local_digest(plan.seq, replica.checksum)))
            if why is not None:
                raise Desync(why)
        return any(isinstance(op, Shutdown) for op in plan.ops)


def run_follower(
    settings: Settings, member: Membership, *, optimized_blas: bool, faults: bool
) -> int:
    """Run a follower rank until rank 0 shuts it down; returns the exit code.

    The follower's loop runs on its own engine thread (it owns MLX); this
    thread waits for it. SIGTERM here waits a while for rank 0's shutdown
    plan (the group stops together), then leaves with 0. A lost cluster
    ends the process through :func:`~.watchdog.leave`.
    """
    follower = Follower(settings, member, optimized_blas=optimized_blas, faults=faults)
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(follower.run()), name="mlxd-engine", daemon=True
    )

    def on_term(sig: int, frame: FrameType | None) -> None:
        if follower.stopping.is_set():
            exit_now(1)
        follower.stopping.set()
        logger.info(
            "%s received: waiting for rank 0 to shut the cluster down", signal.Signals(sig).name
        )

        def later() -> None:
            time.sleep(_TERM_WAIT_S)
            logger.warning("rank 0 sent no shutdown within %gs; exiting", _TERM_WAIT_S)
            exit_now(0)

        threading.Thread(target=later, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_term)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    code = result[0] if result else EXIT_LOST
    if code == EXIT_LOST:
        leave(follower.lost or "the follower's engine thread ended without a result")
    return code
