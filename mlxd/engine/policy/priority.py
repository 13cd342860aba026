"""Who goes first: priority classes, fair share across keys, aging, and preemption.

Pure policy (docs/batching.md, "Priority and fair share"); the chat engine
orders its queues with :func:`order` before every admission pass and asks
:func:`victim` which running row yields to a waiting one.

The rules:

1. **Classes first.** A waiting request's *effective* class is its own class
   (``high`` < ``normal`` < ``low`` < ``batch``, most urgent first) lifted
   one class for every ``aging`` seconds it has waited in its queue (0: no
   aging), never above ``high``. So a low request under a steady load of
   normal ones runs after at most ``aging`` seconds of waiting, and after
   ``2 * aging`` seconds even a steady load of high ones lets it through.
2. **Preempted rows resume first.** Within its class, a row that yielded
   its place to a more urgent one goes back to the head of the class.
3. **Fair share within a class** (``fair_share = true``): keys take turns.
   A request's turn number is the rows its key has running plus the
   requests of that key waiting ahead of it in the class; the lowest turn
   goes first. Between keys on the same turn, the key served least recently
   (its last admission longest ago, or never) goes first, then arrival
   order. So keys alternate even when one row runs at a time, and one key's
   flood cannot hold another key's single request behind more than one of
   its own per slot. Without fair share, arrival order (FIFO).
4. **FIFO within one key**: a key's requests keep their arrival order.

Preemption (``preempt = true``) only ever acts on a waiting request's own
class, never its aged one: aging lets a request *go before* others, not
push a running row out, so an old low request cannot preempt anyone and
two rows can never preempt each other back and forth. The victim is the
least urgent running row less urgent than the waiter, the most recently
started among those (it has the least work to pause).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Priority classes, most urgent first (mlxd.engine.messages.Priority).
CLASSES: tuple[str, ...] = ("high", "normal", "low", "batch")
RANK = {name: i for i, name in enumerate(CLASSES)}


def rank(priority: str) -> int:
    """A class's rank: 0 for ``high``, larger is less urgent; unknown names are ``normal``."""
    return RANK.get(priority, RANK["normal"])


def capped(requested: str | None, ceiling: str) -> str:
    """The class a request runs at: the one it asked for, never more urgent than ``ceiling``
    (its key's class). None asks for the key's class."""
    if requested is None or requested not in RANK:
        return ceiling
    return requested if rank(requested) >= rank(ceiling) else ceiling


@dataclass(frozen=True)
class Rules:
    """The ``[scheduling]`` keys the order depends on."""

    fair_share: bool = True
    aging_s: float = 60.0


@dataclass(frozen=True)
class Waiting:
    """One queued request as the order sees it.

    ``seq`` is its arrival number (smaller arrived first), ``queued_at`` when
    it (re-)entered the queue, ``resumed`` whether it was preempted.
    """

    priority: str
    key: str
    seq: int
    queued_at: float
    resumed: bool = False


def effective(item: Waiting, now: float, rules: Rules) -> int:
    """The class rank ``item`` is ordered by: its own, lifted one per ``aging_s`` waited."""
    own = rank(item.priority)
    if rules.aging_s <= 0:
        return own
    lifted = int(max(0.0, now - item.queued_at) // rules.aging_s)
    return max(0, own - lifted)


def order(
    items: Sequence[Waiting],
    running: Mapping[str, int],
    now: float,
    rules: Rules,
    served: Mapping[str, float] | None = None,
) -> list[int]:
    """The indices of ``items`` in the order admission takes them.

    ``running`` counts each key's rows that run now (fair share's turns
    start after them); ``served`` is when each key last had a request
    admitted (a key not in it was never served, and goes first on a tie).
    """
    served = served or {}
    classes = [effective(item, now, rules) for item in items]
    turn = [0] * len(items)
    if rules.fair_share:
        ahead: dict[tuple[int, str], int] = {}
        # Within one class, a key's requests in their arrival order (resumed rows first).
        for i in sorted(range(len(items)), key=lambda i: (not items[i].resumed, items[i].seq)):
            slot = (classes[i], items[i].key)
            turn[i] = running.get(items[i].key, 0) + ahead.get(slot, 0)
            ahead[slot] = ahead.get(slot, 0) + 1
    never = float("-inf")

    def last(i: int) -> float:
        return served.get(items[i].key, never) if rules.fair_share else never

    return sorted(
        range(len(items)),
        key=lambda i: (classes[i], not items[i].resumed, turn[i], last(i), items[i].seq),
    )


@dataclass(frozen=True)
class Running:
    """One running row as preemption sees it: its class, when it started, whether it may yield."""

    priority: str
    started_at: float
    preemptible: bool = True


def victim(waiter: str, rows: Sequence[Running]) -> int | None:
    """The index of the row that yields to a request of class ``waiter``, or None.

    Only a preemptible row of a less urgent class yields: the least urgent
    of those, and among equals the most recently started.
    """
    want = rank(waiter)
    best: int | None = None
    for i, row in enumerate(rows):
        if not row.preemptible or rank(row.priority) <= want:
            continue
        if best is None:
            best = i
            continue
        b = rows[best]
        if (rank(row.priority), row.started_at) > (rank(b.priority), b.started_at):
            best = i
    return best
