"""Where a running daemon listens, recorded in the state directory for ``mlxd status``/``reload``.

``mlxd serve --port 18100 --config mlxd.toml`` listens on 18100 while the
file says 8080. Once bound, the daemon writes its real address to
``<[server] state_dir>/daemons/<key>.json`` (``key``: a hash of the config
file's absolute path, so two daemons of two configs never share a record),
and removes it when it stops. ``mlxd status --config mlxd.toml`` reads it
back and talks to that daemon; a record whose process is gone, or a corrupt
one, is ignored. Standard library only: the CLI reads it without the web stack.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_MAX_BYTES = 4096  # a record is a few hundred bytes; anything larger is not ours


@dataclass(frozen=True)
class Recorded:
    """A daemon's record: its URL, its process and the file it came from."""

    url: str
    pid: int
    path: Path


def url_for(host: str, port: int) -> str:
    """The URL a client on this machine reaches ``host:port`` at (any address: loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def record_path(state_dir: Path, config_path: Path | None) -> Path:
    """The record of the daemon that runs ``config_path`` (None: built-in defaults)."""
    name = str(Path(config_path).expanduser().resolve()) if config_path is not None else ""
    key = hashlib.sha256(name.encode("utf-8")).hexdigest()[:16]
    return Path(state_dir).expanduser() / "daemons" / f"{key}.json"


def write_record(state_dir: Path, config_path: Path | None, url: str) -> Path | None:
    """Record this process's ``url`` atomically; a failure is a warning (returns None)."""
    path = record_path(state_dir, config_path)
    body = {
        "url": url,
        "pid": os.getpid(),
        "config": str(Path(config_path).resolve()) if config_path is not None else None,
        "started_at": time.time(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(body, f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        logger.warning("cannot record this daemon's address in %s: %s", path.parent, exc)
        return None
    return path


def remove_record(path: Path | None) -> None:
    """Remove this process's record (at a clean stop); someone else's is left alone."""
    if path is None:
        return
    found = _read(path)
    if found is not None and found.pid == os.getpid():
        with contextlib.suppress(OSError):
            path.unlink()


def read_record(state_dir: Path, config_path: Path | None) -> Recorded | None:
    """The live daemon recorded for ``config_path``, or None (none, gone, or corrupt)."""
    found = _read(record_path(state_dir, config_path))
    if found is None or not _alive(found.pid):
        return None
    return found


def _read(path: Path) -> Recorded | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
        if len(raw) > _MAX_BYTES:
            return None
        body = json.loads(raw)
        url, pid = body["url"], body["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(url, str) or not url.startswith("http") or not isinstance(pid, int):
        return None
    return Recorded(url, pid, path)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    except OSError:
        return False
    return True
