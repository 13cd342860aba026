"""Prompt-cache lookups: what each admitted request found, and the log /stats shows.

A lookup happens when a request leaves the queue (both lanes). Besides the
cached prefix itself (:class:`Fetched`), it measures how far the prompt ran
along anything the cache held (the trie's common prefix), so a partial hit
or a miss says *where* the prompt diverged; :func:`make_lookup` turns that
into the :class:`~mlxd.engine.messages.CacheLookup` the request's client gets
(the ``X-Mlxd-Prompt-Cache`` header), and :class:`LookupLog` keeps the last
few per model, with the counts, for the snapshot. Runs on the engine thread;
decoding the two snippets costs a few dozen tokens' detokenizing, and only
on a partial hit or a miss.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from mlxd.engine.messages import CacheLookup, CacheSource
from mlxd.engine.snapshot import LookupRecord

# Tokens decoded on each side of the divergence point, and the characters kept.
SNIPPET_TOKENS = 24
SNIPPET_CHARS = 60
# Lookups kept per model for /stats and the dashboard.
KEPT = 32


@dataclass(frozen=True)
class Fetched:
    """A prompt's nearest cached prefix, and how far it matched what the cache held.

    ``cache`` and ``rest`` are the prompt cache's answer (a copy of the cached
    state, and the tokens still to prefill); ``common`` is the longest prefix
    of the prompt that any stored entry shares, whether or not its state
    could be reused; ``source`` where ``cache`` came from.
    """

    cache: list[Any] | None
    rest: list[int]
    common: int
    source: CacheSource = "ram"
    # Entries the cache held for the model when it looked.
    stored: int = 0

    def cached_tokens(self, prompt_tokens: int) -> int:
        return prompt_tokens - len(self.rest)


def make_lookup(prompt: list[int], fetched: Fetched, tokenizer: Any) -> CacheLookup:
    """The lookup a request reports: counts, source, and where it diverged.

    A full hit (every prompt token but the one generation needs to feed was
    cached) has no divergence point. Otherwise ``diverged_at`` is the common
    prefix with the cache, and the snippets are the prompt's text around it.
    """
    n = len(prompt)
    if fetched.source == "off":
        return CacheLookup(n, 0, "off", None)
    cached = fetched.cached_tokens(n)
    source: CacheSource = fetched.source if cached > 0 else "none"
    if cached >= n - 1:
        return CacheLookup(n, cached, source, None, stored=fetched.stored)
    at = min(fetched.common, n)
    before = _decode(tokenizer, prompt[max(0, at - SNIPPET_TOKENS) : at])[-SNIPPET_CHARS:]
    after = _decode(tokenizer, prompt[at : at + SNIPPET_TOKENS])[:SNIPPET_CHARS]
    return CacheLookup(n, cached, source, at, stored=fetched.stored, before=before, after=after)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if not ids:
        return ""
    try:
        return str(tokenizer.decode(ids))
    except Exception:  # a snippet is a courtesy: never fail a request over it
        return ""


class LookupLog:
    """The last lookups of one engine's model, and the counts they add up to.

    Owned by the engine thread; :meth:`records` and the counts are copied
    into each snapshot.
    """

    def __init__(self, kept: int = KEPT):
        self._records: deque[LookupRecord] = deque(maxlen=kept)
        self.ram_tokens = 0
        self.disk_tokens = 0
        # [prompt_cache] volatile_rules applied, by rule name.
        self.rules: dict[str, int] = {}

    def add(
        self,
        model: str,
        request_id: str,
        api: str,
        lookup: CacheLookup,
        rules: tuple[str, ...] = (),
        at: float | None = None,
    ) -> None:
        if lookup.source == "ram":
            self.ram_tokens += lookup.cached_tokens
        elif lookup.source == "disk":
            self.disk_tokens += lookup.cached_tokens
        for rule in rules:
            self.rules[rule] = self.rules.get(rule, 0) + 1
        self._records.append(
            LookupRecord(
                at=time.time() if at is None else at,
                model=model,
                request_id=request_id,
                api=api,
                prompt_tokens=lookup.prompt_tokens,
                cached_tokens=lookup.cached_tokens,
                source=lookup.source,
                diverged_at=lookup.diverged_at,
                stored=lookup.stored,
                before=lookup.before,
                after=lookup.after,
                rules=rules,
            )
        )

    def records(self) -> tuple[LookupRecord, ...]:
        """Newest first."""
        return tuple(reversed(self._records))
