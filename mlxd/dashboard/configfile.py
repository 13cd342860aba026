"""The config file on disk: atomic writes, the last versions, conflict detection.

Pure file operations, no web and no settings: the editor validates text
before it asks for a write. A write is a temp file in the same directory,
written, flushed and fsynced, renamed over the file, then the directory is
fsynced; the file keeps its permissions. The version it replaces goes to a
history folder next to it (``.mlxd.toml.history/``), which keeps the last
:data:`KEEP` versions, each named by when it was replaced.

Every write names the sha256 of the file as its caller last saw it; when the
file on disk differs (someone edited it with vim meanwhile), nothing is
written and :class:`Conflict` carries what is on disk now.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

KEEP = 5
_STAMP = "%Y%m%dT%H%M%S"
_BACKUP_NAME = re.compile(r"^(\d{8}T\d{6})\.(\d{6})Z(?:-\d+)?\.toml$")


@dataclass(frozen=True)
class Current:
    """The file as read now: its text and the sha256 of its bytes."""

    text: str
    sha256: str
    exists: bool = True


@dataclass(frozen=True)
class Backup:
    """One previous version in the history folder."""

    name: str  # the file name in the history folder; what rollback asks for
    path: Path
    replaced_at: float  # when it stopped being the current file
    written_at: float  # when it had been written (its mtime)
    size: int


class Conflict(Exception):
    """The file on disk changed since the caller read it; nothing was written."""

    def __init__(self, path: Path, expected: str, disk: Current):
        self.path = path
        self.expected = expected
        self.disk = disk
        super().__init__(
            f"{path} changed on disk since it was loaded (sha256 {disk.sha256[:12]}, "
            f"expected {expected[:12]}); nothing was written"
        )


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_current(path: Path) -> Current:
    """The file's text and hash; a missing file reads as empty (``exists=False``).

    Raises:
        OSError: the file exists but cannot be read.
        UnicodeDecodeError: it is not UTF-8.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return Current("", digest(b""), exists=False)
    return Current(data.decode("utf-8"), digest(data))


def history_dir(path: Path) -> Path:
    path = Path(path)
    return path.parent / f".{path.name}.history"


def list_history(path: Path) -> list[Backup]:
    """The kept versions, newest first."""
    folder = history_dir(path)
    try:
        names = [n for n in os.listdir(folder) if _BACKUP_NAME.match(n)]
    except FileNotFoundError:
        return []
    backups = []
    for name in sorted(names, reverse=True):
        file = folder / name
        with contextlib.suppress(FileNotFoundError):
            st = file.stat()
            backups.append(Backup(name, file, _replaced_at(name), st.st_mtime, st.st_size))
    return backups


def read_backup(path: Path, name: str) -> str:
    """The text of the kept version ``name`` (a name from :func:`list_history`).

    Raises:
        KeyError: no such version (or a name that is not a version's).
    """
    if not _BACKUP_NAME.match(name):
        raise KeyError(name)
    try:
        return (history_dir(path) / name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeyError(name) from None


def check_unchanged(path: Path, expected_sha256: str) -> Current:
    """The file as it is now, if its hash is still ``expected_sha256``.

    Raises:
        Conflict: the file on disk differs from what the caller saw.
    """
    disk = read_current(path)
    if disk.sha256 != expected_sha256:
        raise Conflict(Path(path), expected_sha256, disk)
    return disk


def save(path: Path, text: str, *, expected_sha256: str) -> Backup | None:
    """Write ``text`` as the file, keeping the version it replaces.

    Nothing happens when the file already holds exactly ``text``.

    Returns:
        The backup of the replaced version, or None (no file before, or no change).

    Raises:
        Conflict: the file changed on disk since the caller read it.
        OSError: the file or its history cannot be written; the file is unchanged.
    """
    path = Path(path)
    disk = check_unchanged(path, expected_sha256)
    if disk.exists and disk.text == text:
        return None
    backup = _keep(path, disk.text) if disk.exists else None
    atomic_write(path, text)
    return backup


def rollback(path: Path, name: str, *, expected_sha256: str) -> str:
    """Make the kept version ``name`` the current file again; returns its text.

    The current file goes into the history like on any other write.

    Raises:
        KeyError: no such version.
        Conflict: the file changed on disk since the caller read it.
        OSError: the write failed; the file is unchanged.
    """
    text = read_backup(path, name)
    save(path, text, expected_sha256=expected_sha256)
    return text


def atomic_write(path: Path, text: str, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``text`` so readers see the old or the new file, never half.

    Keeps the file's permission bits (and owner, where allowed); a symlink is
    followed, so the file it points to is replaced, not the link. ``mode``
    is used for a file that does not exist yet (default 0o600).
    """
    target = Path(os.path.realpath(path))
    try:
        st: os.stat_result | None = target.stat()
    except FileNotFoundError:
        st = None
    keep_mode = stat.S_IMODE(st.st_mode) if st else (0o600 if mode is None else mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, keep_mode)
        if st is not None and (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
            # Only root may give a file away; anyone else keeps their own.
            with contextlib.suppress(PermissionError):
                os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def clean_stray_temps(path: Path) -> list[Path]:
    """Remove temp files a killed write left next to the file or in its history.

    :func:`atomic_write` names them ``.<name>.<random>.tmp``; one survives only
    when the process died between creating and renaming it. Call this at start,
    when nothing else writes the file.

    Returns:
        The files removed.
    """
    target = Path(os.path.realpath(path))
    removed = []
    for folder, name in ((target.parent, target.name), (history_dir(path), None)):
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith(".tmp"):
                continue
            if name is not None and not entry.startswith(f".{name}."):
                continue
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                (folder / entry).unlink()
                removed.append(folder / entry)
    return removed


def _keep(path: Path, text: str) -> Backup:
    """Copy the current version into the history, then prune it to :data:`KEEP`."""
    folder = history_dir(path)
    folder.mkdir(mode=0o700, exist_ok=True)
    now = time.time()
    stamp = time.strftime(_STAMP, time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    name, n = f"{stamp}.toml", 1
    while (folder / name).exists():
        name, n = f"{stamp}-{n}.toml", n + 1
    file = folder / name
    source = Path(os.path.realpath(path))
    st = source.stat()
    # Same permissions as the file: the history holds the same secrets.
    atomic_write(file, text, mode=stat.S_IMODE(st.st_mode))
    os.utime(file, (st.st_atime, st.st_mtime))
    for old in list_history(path)[KEEP:]:
        with contextlib.suppress(FileNotFoundError):
            old.path.unlink()
    return Backup(name, file, _replaced_at(name), st.st_mtime, len(text.encode("utf-8")))


def _replaced_at(name: str) -> float:
    match = _BACKUP_NAME.match(name)
    assert match is not None
    return calendar.timegm(time.strptime(match.group(1), _STAMP)) + int(match.group(2)) / 1e6


def _fsync_dir(folder: Path) -> None:
    # The rename is only durable once the directory entry is on disk.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
