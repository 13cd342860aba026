"""The KV budget in effect for one model, and the config key that sets it.

Three keys can bind: ``[batch] kv_budget`` (the model's own cap, or what
``"auto"`` leaves of device memory), ``[memory] budget`` (what the weights
and prompt-cache reservations of every loaded model leave), and the model's
own ``prompt_cache.max_bytes`` when it is its prompt-cache reservation that
leaves too little. A refusal names the key that is actually the cause, with
sizes in human units. Pure: numbers in, a value and sentences out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mlxd.config import Settings, format_bytes

Binds = Literal["kv_budget", "auto", "memory"]


@dataclass(frozen=True)
class PoolRoom:
    """What the shared ``[memory] budget`` leaves one model for KV."""

    budget: int  # [memory] budget
    reserved: int  # weights and prompt-cache caps of every loaded model (this one included)
    cache_cap: int  # this model's prompt-cache cap, part of ``reserved``

    @property
    def ceiling(self) -> int:
        return max(0, self.budget - self.reserved)


@dataclass(frozen=True)
class KvRoom:
    """The KV bytes a model's batch may use, and why it is that many.

    ``budget_key`` and ``cache_key`` are how the model's KV budget and
    prompt-cache cap are written in the config (``[batch] kv_budget``, or
    ``[models.<id>.batch] kv_budget`` when the model sets its own).
    """

    bytes: int
    binds: Binds
    pool: PoolRoom | None = None
    budget_key: str = "[batch] kv_budget"
    cache_key: str = "[prompt_cache] max_bytes"

    def cause(self, needed: int) -> str:
        """The config key that keeps ``needed`` bytes from fitting."""
        if self.binds == "memory":
            pool = self.pool
            assert pool is not None
            without_cache = pool.budget - (pool.reserved - pool.cache_cap)
            if pool.cache_cap > 0 and needed <= without_cache:
                return self.cache_key
            return "[memory] budget"
        return self.budget_key

    def over(self, needed: int, what: str) -> str:
        """Why ``needed`` bytes for ``what`` can never fit, and which key to change.

        ``what`` starts the sentence: "This request (12 prompt tokens + 50 to generate)".
        """
        have = format_bytes(self.bytes)
        head = f"{what} needs about {format_bytes(needed)} of KV cache"
        shorten = "Shorten the prompt or max_tokens, or"
        key = self.budget_key
        if self.binds == "kv_budget":
            return f"{head}, more than {key} ({have}). {shorten} raise {key}."
        if self.binds == "auto":
            return (
                f'{head}, more than the {have} that {key} = "auto" leaves of the device\'s '
                f"memory after the weights, the prompt cache and a headroom. {shorten} set "
                f"{key} to a size."
            )
        pool = self.pool
        assert pool is not None
        cache = self.cause(needed) == self.cache_key
        of_it = (
            f", {format_bytes(pool.cache_cap)} of it for this model's prompt cache "
            f"({self.cache_key})"
            if cache
            else ""
        )
        if pool.ceiling == 0:
            return (
                f"{head}, but [memory] budget ({format_bytes(pool.budget)}) is over-committed: "
                f"the loaded models reserve {format_bytes(pool.reserved)} for weights and prompt "
                f"caches{of_it}, which leaves no KV room for any request, and no idle unpinned "
                "model is left to unload. Raise [memory] budget, "
                + (f"lower {self.cache_key}, " if cache else "")
                + "or unpin or unload a model."
            )
        where = (
            f"more than the {have} of KV room that [memory] budget ({format_bytes(pool.budget)}) "
            f"leaves: the loaded models reserve {format_bytes(pool.reserved)} for weights and "
            "prompt caches"
        )
        if cache:
            return (
                f"{head}, {where}{of_it}. {shorten} lower {self.cache_key} or raise "
                "[memory] budget."
            )
        return f"{head}, {where}. {shorten} raise [memory] budget or unload other models."


def kv_room(
    kv_budget: int | Literal["auto"],
    *,
    auto_bytes: int,
    pool: PoolRoom | None,
    keys: tuple[str, str] = ("[batch] kv_budget", "[prompt_cache] max_bytes"),
) -> KvRoom:
    """The room in effect: ``[batch] kv_budget`` (or ``auto_bytes`` for ``"auto"``),
    within what the shared ``pool`` leaves when there is one. ``keys``: how the
    model's KV budget and prompt-cache cap are written (see :func:`config_key`)."""
    budget_key, cache_key = keys
    if pool is None and kv_budget == "auto":
        return KvRoom(auto_bytes, "auto", None, budget_key, cache_key)
    if kv_budget != "auto" and (pool is None or kv_budget <= pool.ceiling):
        return KvRoom(kv_budget, "kv_budget", pool, budget_key, cache_key)
    assert pool is not None
    return KvRoom(pool.ceiling, "memory", pool, budget_key, cache_key)


def config_key(settings: Settings, section: str, key: str) -> str:
    """How ``[section] key`` is written for the model ``settings`` serve: in its own
    ``[models.<id>.<section>]`` table when it sets the key there."""
    own = getattr(settings.model, section, None)
    if own is not None and getattr(own, key, None) is not None:
        return f"[models.{settings.model.name}.{section}] {key}"
    return f"[{section}] {key}"
