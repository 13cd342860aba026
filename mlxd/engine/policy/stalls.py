"""When a waiting request counts as stalled.

A request that waits while rows run waits for them to finish; one that is
refused while its lane is idle and no other model holds the memory it needs
waits for nothing that will ever change. mlxd refuses or re-plans every
request that can never fit (docs/batching.md, "Admission never wedges"), so
such a wait is a bug: the watch turns it into a visible state (``/stats``
``stalled_reason``, ``/ready`` 503) instead of a silent wedge, and
admission stops letting that request hold up the ones behind it.

Pure: the engine reports each admission pass, the watch answers.
"""

from __future__ import annotations

from dataclasses import dataclass

# A head refused on an idle lane this many passes in a row, for at least this
# long, is stalled ("a few steps": one refused pass can be a race with
# another model's claim on a shared memory budget).
STALL_PASSES = 5
STALL_SECONDS = 0.5


@dataclass
class StallWatch:
    """Counts consecutive admission passes that refused the same request on an idle lane."""

    request_id: str | None = None
    passes: int = 0
    since: float = 0.0

    def observe(self, stuck: str | None, now: float) -> bool:
        """Report one pass: ``stuck`` is the id of the request refused while its lane was
        idle and its budget free, or None. True once that request counts as stalled."""
        if stuck is None or stuck != self.request_id:
            self.request_id = stuck
            self.passes = 0 if stuck is None else 1
            self.since = now
            return False
        self.passes += 1
        return self.passes >= STALL_PASSES and now - self.since >= STALL_SECONDS
