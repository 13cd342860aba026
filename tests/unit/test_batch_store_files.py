"""The Batch API store's files folder: leftovers swept at start, only regular files read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mlxd.api.batches.store import Store, is_regular, open_regular, sweep


def test_a_start_sweeps_what_a_killed_upload_left(tmp_path: Path):
    files = tmp_path / "batches" / "files"
    files.mkdir(parents=True)
    (files / "tmpab12cd34").write_bytes(b"x" * 1000)  # python-multipart's spool name
    (files / ".upload-file-1").write_bytes(b"half a body")
    (files / "file-2.jsonl").write_bytes(b"{}\n")
    os.mkfifo(files / "tmpfifo")
    store = Store(tmp_path / "batches")
    store.open()
    try:
        assert sorted(p.name for p in files.iterdir()) == ["file-2.jsonl", "tmpfifo"]
    finally:
        store.close()
    assert sweep(files) == 0


def test_only_regular_files_are_opened(tmp_path: Path):
    outside = tmp_path / "secret"
    outside.write_bytes(b"not for clients")
    files = tmp_path / "files"
    files.mkdir()
    (files / "good.jsonl").write_bytes(b"{}\n")
    os.mkfifo(files / "fifo.jsonl")
    (files / "link.jsonl").symlink_to(outside)
    assert is_regular(files / "good.jsonl")
    with open_regular(files / "good.jsonl") as f:
        assert f.read() == b"{}\n"
    for name in ("fifo.jsonl", "link.jsonl", "missing.jsonl"):
        assert not is_regular(files / name)
        started = time.monotonic()
        with pytest.raises(OSError):
            open_regular(files / name)
        assert time.monotonic() - started < 1.0  # a FIFO with no writer does not block
