"""The disk tier's files: reading their headers, and the thread that writes and evicts them.

A prompt-cache entry on disk is one file in mlx-lm's own format
(``save_prompt_cache``: safetensors, the cache's arrays plus metadata),
read back with ``load_prompt_cache``. mlxd's metadata names the model the
entry belongs to and the token ids it holds (:mod:`.prompt_disk`).

Writing happens on a :class:`DiskWriter` thread, never on the engine
thread. The engine thread hands it cache objects whose arrays are already
evaluated; saving an evaluated array reads its buffer and needs no MLX
stream, so it is safe off the thread that made it (mlx 0.32, measured;
docs/design.md, "The prompt cache"). The job, and with it the arrays, goes
back to the engine thread, which drops the last reference: arrays are freed
on the thread that made them.

Every file carries a checksum of its tensor bytes in its metadata
(:mod:`.disk_checksum`): the writer saves it with a placeholder, then seals it.

Every write goes to a unique dot-named temp file, is fsynced, then renamed
into place, so a reader (this daemon or another one sharing the directory)
sees a whole file or none. After each write the directory is brought back
under its byte cap, oldest modification time first (a hit touches its
file). Files that vanish meanwhile (another daemon evicted them) are
skipped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import shutil
import stat
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.config.units import format_bytes
from mlxd.engine.chat.disk_checksum import (
    CHECKSUM,
    PLACEHOLDER,
    CorruptEntry,
    open_regular,
    seal,
)

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
# A header larger than this is not one of ours (a 1M-token entry's is ~6 MiB).
_HEADER_MAX = 64 * 2**20
# Temp files of a writer that died are removed once this old.
_STALE_TEMP_S = 3600.0
# Errors that will not go away by retrying: the tier turns itself off.
_FATAL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def read_metadata(path: Path) -> tuple[dict[str, str], int]:
    """The safetensors metadata of ``path`` and the file's size, checking that it is whole.

    Raises:
        CorruptEntry: the header is unreadable, or the file is shorter or
            longer than the header says (truncated, or not ours).
        OSError: the file cannot be read (it may have just been evicted).
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise CorruptEntry("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_MAX or 8 + n > size:
            raise CorruptEntry(f"header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
            metadata = header.get("__metadata__") or {}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise CorruptEntry(f"unreadable header: {exc}") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptEntry("metadata is not a map of strings")
    if 8 + n + max(ends, default=0) != size:
        raise CorruptEntry(f"{size} bytes, the header describes {8 + n + max(ends, default=0)}")
    return metadata, size


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` and its parent (the tier's root) for this user only, if missing."""
    for d in (directory.parent, directory):
        if not d.is_dir():
            d.parent.mkdir(parents=True, exist_ok=True)
            d.mkdir(mode=0o700, exist_ok=True)


def remove_quietly(path: Path) -> bool:
    """Unlink ``path``; False when it was already gone (or cannot be removed)."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("cannot remove the prompt-cache file %s: %s", path, exc)
        return False


def entry_files(directory: Path) -> list[os.DirEntry[str]]:
    """The entry files of one model's directory: regular files only (no FIFO, device or
    symlink, which could hang a read or lead out of the folder); temp files are dot-named."""
    try:
        with os.scandir(directory) as it:
            return [
                e
                for e in it
                if e.name.endswith(SUFFIX)
                and not e.name.startswith(".")
                and e.is_file(follow_symlinks=False)
            ]
    except FileNotFoundError:
        return []


def usage(root: Path, now: float | None = None) -> list[tuple[float, int, Path]]:
    """``(mtime, bytes, path)`` of every entry under ``root``, every model's; old temps go."""
    now = time.time() if now is None else now
    found = []
    try:
        subdirs = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    for sub in subdirs:
        try:
            with os.scandir(sub.path) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue  # evicted by another writer meanwhile
            if e.name.startswith("."):
                if now - st.st_mtime > _STALE_TEMP_S:
                    remove_quietly(Path(e.path))
            elif e.name.endswith(SUFFIX) and stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, st.st_size, Path(e.path)))
    return found


# ------------------------------------------------------------ the writer's jobs and results


@dataclass(eq=False)
class Write:
    """Save ``cache`` as ``directory/name`` with ``metadata``; ``key`` is the engine's."""

    directory: Path
    name: str
    cache: list[Any]
    metadata: dict[str, str]
    nbytes: int
    key: Any = None
    # Set by the writer: the file's size, or why it was not written.
    written_bytes: int = 0
    error: str | None = None
    fatal: bool = False


@dataclass(eq=False)
class Touch:
    path: Path


@dataclass(eq=False)
class Remove:
    paths: list[Path]


@dataclass(eq=False)
class Enforce:
    """Bring ``root`` under ``cap`` bytes (after a lowered cap)."""


@dataclass
class Results:
    """What the writer did since the engine last looked (engine thread reads, under a lock)."""

    writes: list[Write] = field(default_factory=list)
    evicted: list[Path] = field(default_factory=list)


class DiskWriter:
    """One thread that writes, touches, removes and evicts entry files under ``root``.

    Args:
        root: The tier's directory (one subdirectory per model identity).
        cap: ``disk_max_bytes``: the whole directory's cap.
        name: The thread's name.
    """

    def __init__(self, root: Path, cap: int, *, name: str):
        self.root = root
        self.cap = cap
        self._jobs: queue.SimpleQueue[Write | Touch | Remove | Enforce | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._results = Results()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread

    def submit(self, job: Write | Touch | Remove | Enforce) -> None:
        with self._lock:
            self._busy += 1
        self._jobs.put(job)

    def take(self) -> Results:
        """The results since the last call (the engine thread frees the written caches)."""
        with self._lock:
            results, self._results = self._results, Results()
        return results

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted job is done; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self, timeout: float) -> bool:
        """Finish the queued jobs (up to ``timeout``), then end the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            evicted: list[Path] = []
            try:
                if isinstance(job, Write):
                    self._write(job)
                    if job.error is None:
                        evicted = self._enforce()
                elif isinstance(job, Touch):
                    _touch(job.path)
                elif isinstance(job, Remove):
                    evicted = [p for p in job.paths if remove_quietly(p)]
                else:
                    evicted = self._enforce()
            except Exception as exc:  # never let the thread die
                logger.exception("prompt-cache disk job failed")
                if isinstance(job, Write) and job.error is None:
                    job.error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if isinstance(job, Write):
                    self._results.writes.append(job)
                self._results.evicted.extend(evicted)
                self._busy -= 1
                if not self._busy:
                    self._idle.notify_all()
            del job  # the engine thread holds the last reference to the arrays

    def _write(self, job: Write) -> None:
        from mlx_lm.models.cache import save_prompt_cache

        final = job.directory / job.name
        tmp = job.directory / f".{job.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            make_private_dir(job.directory)
            if job.nbytes > self.cap:
                job.error = f"{job.nbytes} bytes, more than disk_max_bytes ({self.cap})"
                return
            _check_room(job.directory, job.nbytes)
            # Entries hold prompts (their token ids): readable by this user only.
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w+b") as f:
                metadata = {**job.metadata, CHECKSUM: PLACEHOLDER}
                save_prompt_cache(f, job.cache, metadata)  # type: ignore[arg-type]
                f.flush()
                seal(f)
                f.flush()
                os.fsync(f.fileno())
            job.written_bytes = tmp.stat().st_size
            os.replace(tmp, final)
            _fsync_dir(job.directory)
        except OSError as exc:
            remove_quietly(tmp)
            job.error = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
            job.fatal = exc.errno in _FATAL
        except Exception as exc:
            remove_quietly(tmp)
            job.error = f"{type(exc).__name__}: {exc}"

    def _enforce(self) -> list[Path]:
        """Evict the oldest files under ``root`` until it fits ``cap``; returns what went."""
        files = usage(self.root)
        total = sum(size for _, size, _ in files)
        gone = []
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= self.cap:
                break
            if remove_quietly(path):
                gone.append(path)
            total -= size  # gone either way: removed here, or by another writer
        return gone


def _check_room(directory: Path, nbytes: int) -> None:
    """Refuse a write that would leave the volume (nearly) full: ENOSPC before the fact."""
    total, _, free = shutil.disk_usage(directory)
    reserve = min(2**30, total // 20)
    if free - nbytes < reserve:
        raise OSError(
            errno.ENOSPC,
            f"writing {format_bytes(nbytes)} would leave {format_bytes(max(free - nbytes, 0))} "
            f"free of {format_bytes(free)}, and the tier leaves at least {format_bytes(reserve)}",
        )


def _touch(path: Path) -> None:
    # Evicted meanwhile: the engine finds out on its next read.
    with contextlib.suppress(OSError):
        os.utime(path)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename stands
    finally:
        os.close(fd)
