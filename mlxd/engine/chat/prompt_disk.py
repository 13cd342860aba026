"""The prompt cache's disk tier as the engine thread sees it: an index, reads, writes handed off.

Files live in ``<disk_dir>/<model dir>/`` (one directory per model identity:
its path, a fingerprint of its weight files, its dtype, mlx-lm's version and
mlxd's format version), one file per entry, named after a hash of its token
ids. Their metadata repeats the identity and carries the token ids, so the
in-memory index (a :class:`~.prefix_trie.TokenTrie` over the tokens) is built
from the directory alone when a model loads, and survives nothing else.

Reading happens on the engine thread, right before the row that asked for
it is admitted (:func:`DiskTier.load`): ``load_prompt_cache`` plus checks.
Writing happens on the :class:`~.disk_writer.DiskWriter` thread; the engine
thread only hands it evaluated caches and, between two steps, collects what
it did (:meth:`DiskTier.collect`). A file that is truncated, unreadable,
foreign, without a checksum or whose tensor bytes do not match it is a
miss, a warning, and removed (files of another format version live in
another directory and are never read);
a write that fails for good (a full disk, a read-only directory) turns the
tier off with a warning (``disk_state: failed``), never a failed request.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import logging
import os
import re
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.engine.chat.disk_checksum import CHECKSUM, CorruptEntry, verify_payload
from mlxd.engine.chat.disk_writer import (
    SUFFIX,
    DiskWriter,
    Enforce,
    Remove,
    Touch,
    Write,
    entry_files,
    make_private_dir,
    read_metadata,
    remove_quietly,
)
from mlxd.engine.chat.prefix_trie import TokenTrie, Walk

logger = logging.getLogger(__name__)

# Bump when the files' layout or meaning changes: older files are then never read
# (the identity, so the directory, changes; the cap evicts them in time).
# 2: a checksum of the tensor bytes in the metadata.
FORMAT = "2"
# How long a flush (an unload, a swap, a stop) waits for the writer.
FLUSH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ModelIdentity:
    """What a disk entry must match to be reused: the same weights, read the same way."""

    path: str
    weights: str
    dtype: str
    mlx_lm: str
    # The top-level cache classes, one per layer (make_prompt_cache's).
    classes: tuple[str, ...]

    @functools.cached_property
    def digest(self) -> str:
        parts = (FORMAT, self.path, self.weights, self.dtype, self.mlx_lm, *self.classes)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    @property
    def dirname(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(self.path).name).strip("-.") or "model"
        return f"{slug[:48]}-{self.digest[:16]}"

    def matches(self, metadata: dict[str, str]) -> bool:
        return metadata.get("mlxd_format") == FORMAT and metadata.get("model") == self.digest


def model_identity(path: str, dtype: str, classes: tuple[str, ...]) -> ModelIdentity:
    """The identity of the model loaded from ``path``: file names, sizes and times hashed."""
    import mlx_lm

    root = Path(path).resolve()
    h = hashlib.sha256()
    for f in sorted(root.glob("*")):
        if f.suffix == ".safetensors" or f.name == "config.json":
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return ModelIdentity(str(root), h.hexdigest(), dtype, mlx_lm.__version__, classes)


def ours(header: dict[str, str]) -> dict[str, str]:
    """mlxd's metadata in a file's safetensors header (save_prompt_cache files it under ``0.``)."""
    return {k[2:]: v for k, v in header.items() if k.startswith("0.")}


def encode_tokens(tokens: list[int]) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode("ascii")


def decode_tokens(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4").tolist()


def _mtime(f: os.DirEntry[str]) -> float:
    try:
        return f.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def entry_name(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:40] + SUFFIX


@dataclass(eq=False)
class DiskEntry:
    """One file of the index: the tokens it holds and how it may be reused."""

    path: Path
    # 4 bytes a token (a list of ints takes about 36): the index is in memory.
    tokens: array
    nbytes: int
    kind: str
    trimmable: bool


class DiskTier:
    """One model's entries on disk: the index, the reads, and the writer that keeps them.

    Args:
        root: ``disk_dir`` (shared by every model and possibly other daemons).
        identity: The loaded model's.
        cap: ``disk_max_bytes``.
        name: Names the writer thread.
    """

    def __init__(
        self, root: Path, identity: ModelIdentity, cap: int, *, name: str, max_entries: int = 2048
    ):
        self.root = root
        # The index is in memory (every entry's tokens): at most this many entries.
        self.max_entries = max_entries
        self.identity = identity
        self.directory = root / identity.dirname
        self.state = "on"
        self.error: str | None = None
        self.writes = self.hits = self.corrupt = self.write_errors = 0
        self.nbytes = 0
        # Bytes of entries evicted from RAM whose write has not finished: still in memory.
        self.spill_bytes = 0
        self._index: TokenTrie[DiskEntry] = TokenTrie()
        self._by_name: dict[str, DiskEntry] = {}
        self._pending: dict[str, Write] = {}
        self._writer = DiskWriter(root, cap, name=name)
        self._scan()

    def __len__(self) -> int:
        return len(self._by_name)

    # ------------------------------------------------------------ the index

    def _scan(self) -> None:
        try:
            make_private_dir(self.directory)
        except OSError as exc:
            self._fail(f"cannot create {self.directory}: {exc.strerror or exc}")
            return
        for f in sorted(entry_files(self.directory), key=_mtime):  # oldest first (LRU order)
            path = Path(f.path)
            try:
                metadata, size = read_metadata(path)
                entry = self._entry(path, metadata, size)
            except FileNotFoundError:
                continue
            except (CorruptEntry, OSError, ValueError, KeyError) as exc:
                self._drop(path, f"{exc}")
                continue
            self._add(entry)
        self._bound()
        logger.info(
            "prompt cache on disk: %d entries, %d MiB in %s",
            len(self._by_name),
            self.nbytes // 2**20,
            self.directory,
        )

    def _entry(self, path: Path, header: dict[str, str], size: int) -> DiskEntry:
        metadata = ours(header)
        if metadata.get("mlxd_format") != FORMAT:
            raise CorruptEntry(f"format {metadata.get('mlxd_format')!r}, not {FORMAT}")
        if not self.identity.matches(metadata):
            raise CorruptEntry("written for another model (or other weights)")
        if not metadata.get(CHECKSUM):
            raise CorruptEntry("no checksum of its tensor bytes")
        tokens = decode_tokens(metadata["tokens"])
        if not tokens or entry_name(tokens) != path.name:
            raise CorruptEntry("its token ids do not match its name")
        return DiskEntry(
            path,
            array("i", tokens),
            size,
            metadata.get("kind", "assistant"),
            metadata["trimmable"] == "1",
        )

    def _add(self, entry: DiskEntry) -> None:
        previous = self._index.add(entry.tokens, entry)
        if previous is not None:
            self.nbytes -= previous.nbytes
        self._by_name[entry.path.name] = entry
        self.nbytes += entry.nbytes

    def _forget(self, entry: DiskEntry) -> None:
        if self._by_name.pop(entry.path.name, None) is not None:
            self._index.pop(entry.tokens)
            self.nbytes -= entry.nbytes

    def _bound(self) -> None:
        """At most ``max_entries`` in the index: the least recently used go, files and all.

        The bytes cap alone let the index (all in memory) grow without
        bound for a model whose entries are small (issue 34, N13).
        """
        extra = len(self._by_name) - self.max_entries
        if extra <= 0:
            return
        old = list(itertools.islice(self._by_name.values(), extra))
        for entry in old:
            self._forget(entry)
        self._writer.submit(Remove([e.path for e in old]))

    def set_max_entries(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._bound()

    def _drop(self, path: Path, why: str) -> None:
        """A bad file: a warning, a count, and it goes (never a crash, never a failed request)."""
        logger.warning("dropping the prompt-cache file %s: %s", path, why)
        self.corrupt += 1
        remove_quietly(path)
        entry = self._by_name.get(path.name)
        if entry is not None:
            self._forget(entry)

    def walk(self, prompt: list[int]) -> Walk[DiskEntry]:
        return self._index.walk(prompt, limit=len(prompt) - 1, rewindable=lambda e: e.trimmable)

    def has(self, tokens: list[int]) -> bool:
        name = entry_name(tokens)
        return name in self._by_name or name in self._pending

    # ------------------------------------------------------------ reads (engine thread)

    def load(self, entry: DiskEntry) -> list[Any] | None:
        """The cache in ``entry``'s file, checked; None (and the file dropped) when it is bad."""
        import mlx.core as mx
        from mlx_lm.models.cache import load_prompt_cache

        started = time.perf_counter()
        try:
            # The payload first: flipped bytes there would load as a cache that answers wrong.
            verify_payload(entry.path, ours(read_metadata(entry.path)[0]).get(CHECKSUM))
            cache, metadata = load_prompt_cache(str(entry.path), return_metadata=True)
            mx.eval([c.state for c in cache])
            if not self.identity.matches(metadata):
                raise CorruptEntry("written for another model")
            if decode_tokens(metadata["tokens"]) != entry.tokens.tolist():
                raise CorruptEntry("its token ids changed")
            classes = tuple(type(c).__name__ for c in cache)
            if classes != self.identity.classes:
                raise CorruptEntry(f"cache layers {classes}, the model has {self.identity.classes}")
        except FileNotFoundError:
            self._forget(entry)  # evicted meanwhile (another daemon, or our writer)
            return None
        except Exception as exc:
            self._drop(entry.path, f"{type(exc).__name__}: {exc}")
            return None
        self.hits += 1
        self._by_name[entry.path.name] = self._by_name.pop(entry.path.name, entry)  # recent
        self._writer.submit(Touch(entry.path))
        logger.debug(
            "read %d tokens (%d MiB) from disk in %.3fs",
            len(entry.tokens),
            entry.nbytes // 2**20,
            time.perf_counter() - started,
        )
        return cache

    # ------------------------------------------------------------ writes (handed off)

    def write(
        self, tokens: list[int], cache: list[Any], *, kind: str, trimmable: bool, spilled: bool
    ) -> bool:
        """Hand an evaluated cache to the writer; True once it is on disk or on its way there.

        False when the tier is off. ``spilled``: the entry just left RAM, so
        its bytes stay in memory (counted in :attr:`spill_bytes`) until the
        write is done.
        """
        if self.state != "on":
            return False
        name = entry_name(tokens)
        if name in self._pending:
            return True
        if name in self._by_name:
            self._writer.submit(Touch(self._by_name[name].path))
            return True
        nbytes = sum(c.nbytes for c in cache)
        metadata = {
            "mlxd_format": FORMAT,
            "model": self.identity.digest,
            "model_path": self.identity.path,
            "dtype": self.identity.dtype,
            "kind": kind,
            "trimmable": "1" if trimmable else "0",
            "n_tokens": str(len(tokens)),
            "tokens": encode_tokens(tokens),
            "created": f"{time.time():.3f}",
            "pid": str(os.getpid()),
        }
        job = Write(
            self.directory, name, cache, metadata, nbytes, key=(list(tokens), kind, spilled)
        )
        self._pending[name] = job
        if spilled:
            self.spill_bytes += nbytes
        self._writer.submit(job)
        return True

    def collect(self) -> None:
        """Take in what the writer did (engine thread, between steps); frees written caches here."""
        results = self._writer.take()
        for job in results.writes:
            self._pending.pop(job.name, None)
            tokens, kind, spilled = job.key
            if spilled:
                self.spill_bytes -= job.nbytes
            job.cache = []  # the arrays are freed here, on the engine thread
            if job.error is not None:
                self.write_errors += 1
                if job.fatal:
                    self._fail(f"writing {job.directory}: {job.error}")
                else:
                    logger.warning("prompt-cache entry not written: %s", job.error)
                continue
            self.writes += 1
            path = job.directory / job.name
            self._add(
                DiskEntry(
                    path,
                    array("i", tokens),
                    job.written_bytes,
                    kind,
                    job.metadata["trimmable"] == "1",
                )
            )
        for path in results.evicted:
            entry = self._by_name.get(path.name)
            if entry is not None and path.parent == self.directory:
                self._forget(entry)
        self._bound()

    def _fail(self, why: str) -> None:
        if self.state == "on":
            logger.warning("the prompt cache's disk tier is off until a reload or restart: %s", why)
        self.state, self.error = "failed", why

    def set_cap(self, cap: int) -> None:
        if cap != self._writer.cap:
            self._writer.cap = cap
            self._writer.submit(Enforce())

    @property
    def cap(self) -> int:
        return self._writer.cap

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait for every write handed off so far; True when they all finished."""
        done = self._writer.wait_idle(timeout)
        self.collect()
        if not done:
            logger.warning("the prompt cache's disk writes did not finish in %.0fs", timeout)
        return done

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Finish the writes (up to ``timeout``) and stop the writer."""
        done = self.flush(timeout)
        self._writer.stop(timeout if done else 0.1)
        self.collect()
