"""``mlxd reload``, ``mlxd status`` and a busy port, run as a user runs them.

One daemon bound off loopback with an admin token, so the commands must find
its port in the config and send the token; the commands run as subprocesses
(``python -m mlxd ...``) against it.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxd.cli import _parser
from tests.support.daemon import Daemon, free_port, toml_config

TOKEN = "adm-cli-test-token"


def _config(model_dir: Path, port: int, token: str = TOKEN, **batch) -> str:
    return "# the operator's own notes\n" + toml_config(
        server={"host": "0.0.0.0", "port": port, "admin_token": token},
        model={"path": str(model_dir)},
        batch={"size": 2, **batch},
    )


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    # Its own: the tests rewrite its config and reload it; the port is in its config.
    port = free_port()
    return daemons.get(_config(tiny_models("llama"), port), port=port, name="cli")


def mlxd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", *args], capture_output=True, text=True, timeout=timeout
    )


def _stats(d: Daemon) -> dict:
    return httpx.get(f"{d.url}/stats", headers={"X-Mlxd-Admin-Token": TOKEN}, timeout=10).json()


def test_status_finds_the_daemon_of_the_config(daemon: Daemon) -> None:
    done = mlxd("status", "--config", str(daemon.config_path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"mlxd at http://127.0.0.1:{daemon.port}: ready" in out
    assert "batch size 2; running 0, waiting 0" in out
    assert f"from {daemon.config_path}" in out
    json_out = mlxd("status", "--config", str(daemon.config_path), "--json")
    assert '"state": "ready"' in json_out.stdout


def test_reload_applies_and_prints_old_and_new(daemon: Daemon, tiny_models) -> None:
    version = _stats(daemon)["config"]["version"]
    daemon.write_config(_config(tiny_models("llama"), daemon.port, size=3))
    done = mlxd("reload", "--config", str(daemon.config_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"reload: applied (config v{version + 1})" in done.stdout
    assert "batch.size: 2 -> 3 (live)" in done.stdout
    assert _stats(daemon)["batch"]["configured"] == 3
    assert _stats(daemon)["reloads"][0]["trigger"] == "POST /admin/reload"

    again = mlxd("reload", "--config", str(daemon.config_path))
    assert again.returncode == 0 and "reload: unchanged" in again.stdout


def test_reload_of_an_invalid_file_says_where_and_changes_nothing(
    daemon: Daemon, tiny_models
) -> None:
    good = daemon.config_path.read_text()
    version = _stats(daemon)["config"]["version"]
    daemon.write_config(good.replace("size = ", "sise = "))
    try:
        done = mlxd("reload", "--config", str(daemon.config_path))
        assert done.returncode == 1
        assert "reload: rejected" in done.stdout  # still found the daemon
        issue = "[batch] sise: unknown key; did you mean 'size'?"
        assert issue in done.stdout and "line " in done.stdout
        # Said once (issue 22): the daemon's answer, not also the CLI's own note.
        assert (done.stdout + done.stderr).count(issue) == 1, done.stdout + done.stderr
        status = mlxd("status", "--config", str(daemon.config_path))
        assert (status.stdout + status.stderr).count(issue) == 1, status.stdout + status.stderr
        assert _stats(daemon)["config"]["version"] == version
    finally:
        daemon.write_config(good)


def test_a_wrong_token_is_refused_and_nothing_answering_is_said(
    daemon: Daemon, tiny_models, tmp_path: Path
) -> None:
    other = tmp_path / "other.toml"
    other.write_text(_config(tiny_models("llama"), daemon.port, token="not-the-token"))
    refused = mlxd("reload", "--config", str(other))
    assert refused.returncode == 1 and "reload refused (HTTP 401)" in refused.stdout
    assert "admin token required" in refused.stdout

    nobody = mlxd("status", "--config", str(daemon.config_path), "--port", str(free_port()))
    assert nobody.returncode == 1
    assert "no mlxd answers at http://127.0.0.1:" in nobody.stderr


def test_a_busy_port_fails_at_once_and_says_how_to_choose_another(
    tiny_models, tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = tmp_path / "mlxd.toml"
        config.write_text(toml_config(model={"path": str(tiny_models("llama"))}))
        started = time.monotonic()
        done = mlxd("serve", "--config", str(config), "--port", str(port), timeout=60)
        elapsed = time.monotonic() - started
    assert done.returncode == 2
    err = done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is already in use" in err
    assert "is free: mlxd serve --port " in err and "make serve PORT=" in err
    # Before MLX and the model: nothing was loaded, nothing claimed to listen.
    assert "loaded " not in err and "runtime:" not in err and "listening" not in err
    assert elapsed < 30, elapsed


def _actions(parser: argparse.ArgumentParser, name: str = "mlxd"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{name} {choice.dest}", choice.help
            for sub_name, sub in action.choices.items():
                yield from _actions(sub, f"{name} {sub_name}")
        else:
            yield f"{name} {'/'.join(action.option_strings) or action.dest}", action.help


def test_every_subcommand_and_flag_has_help() -> None:
    missing = [where for where, text in _actions(_parser()) if not text]
    assert not missing, f"no help text: {missing}"
    names = {where for where, _ in _actions(_parser())}
    assert {"mlxd reload", "mlxd status", "mlxd status --json"} <= names
