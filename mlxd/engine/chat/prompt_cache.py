"""The prompt (prefix) cache both lanes share: mlx-lm's ``LRUPromptCache``, counted.

Entries are keyed by the loaded model's key, so a swapped model never sees
another model's cache. The cache's byte cap shrinks by the live batch's KV
bytes, so the cache and the batch share one ceiling.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlxd.config import PromptCacheSettings
from mlxd.engine.chat.lookups import LookupLog
from mlxd.engine.snapshot import PromptCacheState


class PromptCache:
    """``LRUPromptCache`` plus hit/miss counts and mlxd's settings."""

    def __init__(self, settings: PromptCacheSettings):
        self._settings = settings
        self._lru = LRUPromptCache(max_size=settings.max_entries, max_bytes=settings.max_bytes)
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        """Entries held (every model's: an engine serves one model at a time)."""
        return len(self._lru)

    @property
    def enabled(self) -> bool:
        return self._settings.max_entries > 0

    def configure(self, settings: PromptCacheSettings, live_bytes: int) -> None:
        """New caps, applied at once (entries beyond them are dropped)."""
        self._settings = settings
        self._lru.max_size = settings.max_entries
        self._lru.max_bytes = settings.max_bytes
        self.trim(live_bytes)

    def fetch(self, model_key: str, prompt: list[int]) -> tuple[list[Any] | None, list[int]]:
        """A copy of the nearest cached prefix, and the tokens still to prefill.

        At least one token is always left to prefill: generation needs a
        token to feed.
        """
        if not self.enabled:
            return None, prompt
        cache, rest = self._lru.fetch_nearest_cache(model_key, prompt)
        if cache is not None and not rest:
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
            else:
                cache, rest = None, prompt
        if cache is None:
            self.misses += 1
        else:
            self.hits += 1
        return cache, rest

    def common_prefix(self, model_key: str, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` some stored entry shares (read only).

        The divergence point a lookup reports: a walk down mlx-lm's token trie,
        one dict lookup per token (mlx-lm has no public walk; its ``search``
        also looks for the shortest longer entry, which this does not need).
        """
        if not self.enabled or not prompt:
            return 0
        node = self._lru._trie._trie.get(model_key)
        depth = 0
        for token in prompt:
            if node is None:
                break
            node = node.get(token)
            if node is not None:
                depth += 1
        return depth

    def store(
        self, model_key: str, tokens: list[int] | None, cache: list[Any] | None, live_bytes: int
    ) -> None:
        """Keep a finished row's cache, keyed by every token it holds."""
        if cache is None or not tokens or not self.enabled:
            return
        self._lru.insert_cache(model_key, list(tokens), cache)
        self.trim(live_bytes)

    def trim(self, live_bytes: int) -> None:
        self._lru.trim_to(n_bytes=self._settings.max_bytes - live_bytes)

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)

    def state(self, cached_tokens_served: int, lookups: LookupLog) -> PromptCacheState:
        return PromptCacheState(
            entries=len(self._lru),
            bytes=self._lru.nbytes,
            max_bytes=self._settings.max_bytes,
            max_entries=self._settings.max_entries,
            hits=self.hits,
            misses=self.misses,
            cached_tokens_served=cached_tokens_served,
            ram_tokens=lookups.ram_tokens,
            disk_tokens=lookups.disk_tokens,
            rules=dict(lookups.rules),
            lookups=lookups.records(),
        )
