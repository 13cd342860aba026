"""``mlxd serve --port`` and the commands that talk to it (issue 22), run as a user runs them.

A daemon started with ``--port`` records its real address in its state
directory, so ``mlxd status --config`` and ``mlxd reload --config`` find it
though the file names another port; the config page lists the values the
daemon runs that the file does not say. Also: the CLI's first-day rough edges
(``check-config --config``, a bad config at start, a busy port's suggestion,
an invalid file's error printed once).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxd.address import read_record, record_path
from mlxd.config import BatchSettings
from mlxd.listen import ListenError, bind
from tests.support.daemon import Daemon, free_port, toml_config


def mlxd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # As a user runs it: the state directory is the config's (the suite sets its own).
    env = {
        k: v for k, v in os.environ.items() if k not in ("MLXD_SERVER__STATE_DIR", "MLXD_CONFIG")
    }
    return subprocess.run(
        [sys.executable, "-m", "mlxd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _config(model: Path, file_port: int, state: Path, size: int = 2) -> str:
    return toml_config(
        server={"port": file_port, "state_dir": str(state)},
        model={"path": str(model)},
        batch={"size": size},
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_models):
    tmp = tmp_path_factory.mktemp("pairing")
    file_port = free_port()  # nothing listens there: only --port is served
    d = Daemon(tmp, _config(tiny_models("llama"), file_port, tmp / "state"))
    d.file_port = file_port  # type: ignore[attr-defined]
    # The state directory comes from the file, as a user's would.
    d.env.pop("MLXD_SERVER__STATE_DIR", None)
    d.start()
    yield d
    d.stop()


def test_status_and_reload_find_a_daemon_started_with_port(daemon: Daemon, tiny_models) -> None:
    assert daemon.port != daemon.file_port  # type: ignore[attr-defined]
    done = mlxd("status", "--config", str(daemon.config_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"mlxd at http://127.0.0.1:{daemon.port}: ready" in done.stdout
    assert f"listens at http://127.0.0.1:{daemon.port}" in done.stderr
    assert f"not at the config's http://127.0.0.1:{daemon.file_port}" in done.stderr  # type: ignore[attr-defined]

    config = daemon.config_path.read_text()
    daemon.write_config(config.replace("size = 2", "size = 3"))
    try:
        reloaded = mlxd("reload", "--config", str(daemon.config_path))
        assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr
        assert "batch.size: 2 -> 3 (live)" in reloaded.stdout
    finally:
        daemon.write_config(config)
        mlxd("reload", "--config", str(daemon.config_path))

    # The record: the real address and pid, in the state directory the file names.
    found = read_record(daemon.workdir / "state", daemon.config_path)
    assert found is not None and found.url == daemon.url
    assert found.pid == daemon.proc.pid  # type: ignore[union-attr]


def test_the_port_flag_still_wins_and_says_how_when_nobody_answers(daemon: Daemon) -> None:
    nobody = mlxd("status", "--config", str(daemon.config_path), "--port", str(free_port()))
    assert nobody.returncode == 1
    assert "no mlxd answers at http://127.0.0.1:" in nobody.stderr
    assert "--port <its port>" in nobody.stderr and "state_dir" in nobody.stderr


def test_a_stale_or_corrupt_record_is_ignored(tmp_path: Path) -> None:
    config = tmp_path / "mlxd.toml"
    port = free_port()
    config.write_text(toml_config(server={"port": port, "state_dir": str(tmp_path / "s")}))
    record = record_path(tmp_path / "s", config)
    record.parent.mkdir(parents=True)
    for body in ("{not json", json.dumps({"url": "http://127.0.0.1:1", "pid": 2**22 + 7})):
        record.write_text(body)
        done = mlxd("status", "--config", str(config))
        assert done.returncode == 1
        assert f"no mlxd answers at http://127.0.0.1:{port} " in done.stderr


def test_the_config_page_shows_the_values_the_file_does_not_say(daemon: Daemon) -> None:
    page = httpx.get(f"{daemon.url}/dashboard/config", timeout=30)
    assert page.status_code == 200, page.text
    text = page.text
    assert 'data-field="overrides"' in text
    assert f'[server] port = {daemon.port}</code> <span class="muted">from --port' in text


def test_check_config_takes_config_like_the_other_commands(
    tmp_path: Path, tiny_embedding_model
) -> None:
    config = tmp_path / "models.toml"
    config.write_text(
        "[models.chat]\ndefault = false\n"
        f'[models.emb]\nkind = "embedding"\npath = "{tiny_embedding_model}"\n'
    )
    flag = mlxd("check-config", "--config", str(config))
    positional = mlxd("check-config", str(config))
    assert flag.returncode == 0 and positional.returncode == 0, flag.stderr
    assert flag.stdout == positional.stdout
    out = flag.stdout
    assert "\n[model]\n" not in out  # a [models.*] registry has no [model] table
    chat = out.split("[models.chat]", 1)[1].split("\n[", 1)[0]
    emb = out.split("[models.emb]", 1)[1].split("\n[", 1)[0]
    assert "default = true" in chat and "default = true" in emb  # as the summary says
    assert "chat: built-in demo model (chat, default" in out
    assert "demo_dtype" in chat and "demo_dtype" not in emb
    nothing = mlxd("check-config")
    assert nothing.returncode == 2 and "--config mlxd.toml" in nothing.stderr
    two = mlxd("check-config", str(config), "--config", str(tmp_path / "other.toml"))
    assert two.returncode == 2 and "give one" in two.stderr


def test_a_bad_config_at_start_is_read_as_lines(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[batch]\nsise = 3\n")
    done = mlxd("serve", "--config", str(bad), "--port", str(free_port()), timeout=60)
    assert done.returncode == 2
    assert "\\n" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].endswith(f"invalid config {bad}:")
    known = ", ".join(BatchSettings.model_fields)
    assert known.startswith("size, prompt_concurrency, prefill_step_size")
    assert lines[1].endswith(
        f"line 2: [batch] sise: unknown key; did you mean 'size'? (known: {known})"
    )


def test_a_busy_port_suggests_a_port_that_is_free() -> None:
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        first.listen()
        port = first.getsockname()[1]
        with contextlib.suppress(OSError):  # taken by someone else: busy either way
            second.bind(("127.0.0.1", port + 1))  # the next one is busy too
        with pytest.raises(ListenError) as refused:
            bind("127.0.0.1", port)
    message = str(refused.value)
    suggested = int(message.split("is free: mlxd serve --port ", 1)[1].split(",", 1)[0])
    assert suggested > port + 1, message
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", suggested))  # it really was free


def test_the_record_is_removed_at_a_clean_stop(daemon: Daemon) -> None:
    # The module's daemon, last in file order: its record goes when it stops cleanly.
    state = daemon.workdir / "state"
    assert read_record(state, daemon.config_path) is not None
    daemon.stop()
    assert not record_path(state, daemon.config_path).exists()
