"""The prompt (prefix) cache both lanes share: entries in RAM, looked up with the disk tier.

An entry is a cache (one per layer, mlx-lm's classes) and the token ids it
holds. A lookup takes the longest stored prefix that is a true prefix of
the new prompt, so caches that cannot be rewound (recurrent state, sliding
windows, lists of both) resume from an exact checkpoint; a cache that can be
rewound (``KVCache``) also serves any shorter prefix of what it holds, cut
back. The lanes store a checkpoint at a prompt's boundaries while they
prefill it (:mod:`.checkpoints`) and the whole row when it ends.

Each entry has a kind: ``system`` (the end of the system/tools prefix),
``user`` (the end of a prompt), ``checkpoint`` (every ``checkpoint_every``
tokens) or ``assistant`` (a finished row, prompt and answer). Eviction takes
the kinds in that reverse order of value, balanced as mlx-lm's
``LRUPromptCache.CacheOrder`` does it, least recently used first within a
kind; a hit makes an entry recent again. The byte cap shrinks by the live
batch's KV bytes, so the cache and the batch share one ceiling.

With the disk tier on (:mod:`.prompt_disk`), ``system`` entries are written
to disk when they are made, ``user`` entries (and ``assistant`` ones that can
be cut back) once they are stable: ``disk_write_delay`` seconds in RAM
without a longer entry of theirs replacing them (a crash keeps them), or
when they leave RAM or the model unloads; a lookup that disk can serve
better than RAM reads the file.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlxd.config import PromptCacheSettings
from mlxd.engine.chat.kv_caches import flatten
from mlxd.engine.chat.prefix_trie import TokenTrie, Walk
from mlxd.engine.chat.prompt_disk import DiskEntry, DiskTier
from mlxd.engine.messages import CacheSource
from mlxd.engine.snapshot import PromptCacheState

logger = logging.getLogger(__name__)

Kind = Literal["system", "user", "checkpoint", "assistant"]
# Evicted first to last (mlx-lm's CacheOrder balances between neighbours).
EVICTION_ORDER: list[str] = ["checkpoint", "assistant", "user", "system"]


def detach(cache: list[Any]) -> list[Any]:
    """Give every recurrent state its own buffer (a batch's extract is a view of all rows')."""
    import mlx.core as mx

    for c in flatten(cache):
        state = getattr(c, "cache", None)
        if isinstance(state, list):
            c.cache = [mx.contiguous(a) if a is not None else None for a in state]
    return cache


@dataclass(eq=False)
class Entry:
    id: int
    tokens: list[int]
    cache: list[Any]
    nbytes: int
    kind: Kind
    trimmable: bool
    on_disk: bool = False


@dataclass(frozen=True)
class Fetched:
    """A lookup's result: the cache to start from (a copy), the tokens left, and the facts.

    ``diverged_at`` and ``stored`` are :class:`~mlxd.engine.messages.CacheLookup`'s.
    """

    cache: list[Any] | None
    rest: list[int]
    source: CacheSource
    diverged_at: int | None
    stored: int


class PromptCache:
    """The RAM tier, the optional disk tier, and the counts /stats shows."""

    def __init__(self, settings: PromptCacheSettings):
        self._settings = settings
        self._trie: TokenTrie[Entry] = TokenTrie()
        self._entries: dict[int, Entry] = {}
        self._order = LRUPromptCache.CacheOrder(list(EVICTION_ORDER))
        self._ids = itertools.count()
        self.nbytes = 0
        self.disk: DiskTier | None = None
        self.hits = self.misses = 0
        self.ram_tokens = self.disk_tokens = 0
        self.checkpoints = 0
        # Entries to write through to disk once stable: entry id -> when (monotonic).
        self._unwritten: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self._settings.max_entries > 0 and self._settings.max_bytes > 0

    @property
    def settings(self) -> PromptCacheSettings:
        return self._settings

    def configure(self, settings: PromptCacheSettings, live_bytes: int) -> None:
        """New caps, applied at once (entries beyond them leave, to disk when it is on)."""
        self._settings = settings
        if self.disk is not None:
            self.disk.set_cap(settings.disk_max_bytes)
            self.disk.set_max_entries(settings.disk_max_entries)
        self.trim(live_bytes)

    # ------------------------------------------------------------ lookup

    def fetch(self, prompt: list[int]) -> Fetched:
        """A copy of the cache of the longest reusable prefix of ``prompt``, and what is left.

        At least the last token is always left to prefill: generation needs
        a token to feed.
        """
        if not self.enabled:
            return Fetched(None, prompt, "off", None, 0)
        limit = len(prompt) - 1
        ram = self._trie.walk(prompt, limit=limit, rewindable=lambda e: e.trimmable)
        ram_entry, ram_len = _best(ram, limit)
        common, stored = ram.common, len(self._entries)
        cache, n, source = None, 0, "none"
        if self.disk is not None:
            found = self.disk.walk(prompt)
            common, stored = max(common, found.common), stored + len(self.disk)
            disk_entry, disk_len = _best(found, limit)
            if disk_entry is not None and disk_len > ram_len:
                read = self._read(disk_entry)
                if read is not None:
                    cache, n, source = (
                        _cut_copy(read, len(disk_entry.tokens), disk_len),
                        disk_len,
                        "disk",
                    )
        if cache is None and ram_entry is not None:
            self._touch(ram_entry)
            cache, n, source = (
                _cut_copy(ram_entry.cache, len(ram_entry.tokens), ram_len),
                ram_len,
                "ram",
            )
        if cache is None:
            self.misses += 1
            return Fetched(None, prompt, "none", min(common, len(prompt)), stored)
        self.hits += 1
        if source == "disk":
            self.disk_tokens += n
        else:
            self.ram_tokens += n
        diverged = None if n >= limit else min(common, len(prompt))
        return Fetched(cache, prompt[n:], source, diverged, stored)

    def _read(self, entry: DiskEntry) -> list[Any] | None:
        """The cache in a disk entry's file, kept in RAM too (the next turn finds it there)."""
        assert self.disk is not None
        cache = self.disk.load(entry)
        if cache is not None:
            self._keep(entry.tokens.tolist(), cache, cast(Kind, entry.kind), on_disk=True)
        return cache

    def _touch(self, entry: Entry) -> None:
        self._order.remove(None, [entry.id])
        self._order.push(None, [entry.id], entry.kind)

    # ------------------------------------------------------------ store and evict

    def not_used(self, source: CacheSource, tokens: int, *, dropped: bool) -> None:
        """Admission cut ``tokens`` off the last hit before using it (``dropped``: all of it)."""
        if source == "disk":
            self.disk_tokens -= tokens
        else:
            self.ram_tokens -= tokens
        if dropped:
            self.hits -= 1
            self.misses += 1

    def store(
        self,
        tokens: list[int] | None,
        cache: list[Any] | None,
        live_bytes: int,
        kind: Kind = "assistant",
    ) -> bool:
        """Keep a cache of ``tokens`` (a finished row, or a checkpoint); True when kept."""
        if cache is None or not tokens or not self.enabled:
            return False
        import mlx.core as mx

        mx.eval([c.state for c in detach(cache)])
        entry = self._keep(list(tokens), cache, kind)
        if entry is None:
            return False
        if kind != "assistant":
            self.checkpoints += 1
        if kind == "system" and self.disk is not None:
            entry.on_disk |= _write(self.disk, entry)
        elif self.disk is not None and _worth_writing(entry):
            # A longer entry of the same conversation replaces its older ones on the way.
            for _, shorter in self._trie.prefixes(entry.tokens):
                self._unwritten.pop(shorter.id, None)
            self._unwritten[entry.id] = time.monotonic() + self._settings.disk_write_delay
        self.trim(live_bytes)
        return entry.id in self._entries

    def _keep(
        self, tokens: list[int], cache: list[Any], kind: Kind, *, on_disk: bool = False
    ) -> Entry | None:
        nbytes = sum(c.nbytes for c in cache)
        if nbytes > self._settings.max_bytes:
            return None
        entry = Entry(
            next(self._ids), tokens, cache, nbytes, kind, can_trim_prompt_cache(cache), on_disk
        )
        previous = self._trie.add(tokens, entry)
        if previous is not None:
            self._unlink(previous)
            entry.on_disk |= previous.on_disk
        self._entries[entry.id] = entry
        self._order.push(None, [entry.id], kind)
        self.nbytes += nbytes
        if entry.trimmable:
            # A cache that can be cut back serves every prefix of its tokens.
            for _, shorter in list(self._trie.prefixes(tokens)):
                self._trie.pop(shorter.tokens)
                self._unlink(shorter)
        return entry

    def _unlink(self, entry: Entry) -> None:
        self._unwritten.pop(entry.id, None)
        self._entries.pop(entry.id, None)
        self._order.remove(None, [entry.id])
        self.nbytes -= entry.nbytes

    def trim(self, live_bytes: int) -> None:
        """Evict until the caps hold; the byte cap yields to the live batch and pending writes."""
        spilling = self.disk.spill_bytes if self.disk is not None else 0
        budget = self._settings.max_bytes - live_bytes - spilling
        self._evict_while(lambda: len(self._entries) > self._settings.max_entries)
        self._evict_while(lambda: self.nbytes > budget)

    def keep(self, entries: int) -> None:
        """Evict until ``entries`` are left (a cluster follower, told by rank 0)."""
        self._evict_while(lambda: len(self._entries) > entries)

    def _evict_while(self, over) -> None:
        while self._entries and over():
            _, (entry_id,) = self._order.pop()
            entry = self._entries[entry_id]
            self._trie.pop(entry.tokens)
            self._unlink(entry)
            self._spill(entry)

    def _spill(self, entry: Entry) -> None:
        if self.disk is not None and not entry.on_disk and _worth_writing(entry):
            _write(self.disk, entry, spilled=True)

    def flush(self) -> None:
        """Write every RAM entry the disk does not have yet, and wait for the writer."""
        disk = self.disk
        if disk is None:
            return
        for entry in list(self._entries.values()):
            if not entry.on_disk and _worth_writing(entry):
                entry.on_disk = _write(disk, entry)
        disk.flush()

    def clear(self) -> None:
        """Drop every RAM entry (the disk keeps its own)."""
        self._trie.clear()
        self._entries.clear()
        self._order = LRUPromptCache.CacheOrder(list(EVICTION_ORDER))
        self.nbytes = 0
        self._unwritten.clear()

    # ------------------------------------------------------------ the disk tier

    def attach_disk(self, disk: DiskTier | None) -> None:
        self.detach_disk()
        self.disk = disk

    def detach_disk(self) -> None:
        """Flush RAM entries to the disk tier, then close it."""
        if self.disk is None:
            return
        self.flush()
        self.disk.close()
        self.disk = None

    def collect(self) -> None:
        """Take in what the disk writer finished, hand it the entries now stable (between steps)."""
        disk = self.disk
        if disk is None:
            return
        disk.collect()
        now = time.monotonic()
        for entry_id, due in list(self._unwritten.items()):
            entry = self._entries.get(entry_id)
            if due > now and entry is not None:
                continue
            del self._unwritten[entry_id]
            if entry is not None and not entry.on_disk:
                entry.on_disk = _write(disk, entry)

    # ------------------------------------------------------------ state

    def state(self, cached_tokens_served: int) -> PromptCacheState:
        s, disk = self._settings, self.disk
        return PromptCacheState(
            entries=len(self._entries),
            bytes=self.nbytes + (disk.spill_bytes if disk is not None else 0),
            max_bytes=s.max_bytes,
            max_entries=s.max_entries,
            hits=self.hits,
            misses=self.misses,
            cached_tokens_served=cached_tokens_served,
            ram_tokens=self.ram_tokens,
            disk_tokens=self.disk_tokens,
            checkpoints=self.checkpoints,
            disk_state=disk.state if disk is not None else "off",
            disk_error=disk.error if disk is not None else None,
            disk_dir=str(disk.directory) if disk is not None else None,
            disk_bytes=disk.nbytes if disk is not None else 0,
            disk_max_bytes=s.disk_max_bytes,
            disk_entries=len(disk) if disk is not None else 0,
            disk_writes=disk.writes if disk is not None else 0,
            disk_hits=disk.hits if disk is not None else 0,
            disk_corrupt=disk.corrupt if disk is not None else 0,
            disk_write_errors=disk.write_errors if disk is not None else 0,
        )


def _write(disk: DiskTier, entry: Entry, *, spilled: bool = False) -> bool:
    """Hand ``entry`` to the disk tier's writer (:meth:`DiskTier.write`)."""
    return disk.write(
        entry.tokens, entry.cache, kind=entry.kind, trimmable=entry.trimmable, spilled=spilled
    )


def _worth_writing(entry: Entry) -> bool:
    """Whether an entry leaving RAM goes to disk (docs/design.md, "The disk tier").

    Periodic checkpoints do not; neither does the finished row of a model that
    cannot be cut back: the next turn starts from the prompt's end checkpoint,
    and the answer's few tokens are not worth hundreds of MB of disk a turn.
    """
    return entry.kind in ("system", "user") or (entry.kind == "assistant" and entry.trimmable)


def _best(walk: Walk[Any], limit: int) -> tuple[Any, int]:
    """The entry a walk offers and the tokens it serves: a true prefix, or one cut back."""
    below_len = min(walk.common, limit) if walk.below is not None else 0
    if below_len > walk.prefix_len:
        return walk.below, below_len
    return walk.prefix, walk.prefix_len


def _cut_copy(cache: list[Any], held: int, n: int) -> list[Any]:
    """A copy of a cache of ``held`` tokens that holds the first ``n``.

    Copies share the arrays (MLX arrays are values); cutting a copy changes
    only the copy.
    """
    cache = copy.deepcopy(cache)
    if held > n:
        trim_prompt_cache(cache, held - n)
    return cache
