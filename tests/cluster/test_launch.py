"""The same cluster started by ``mlx.launch`` (no hostfile or rank in the config).

``mlx.launch -n 2 --backend ring`` starts both ranks on this machine and sets
``MLX_RANK`` and ``MLX_HOSTFILE`` for each; mlxd takes both from there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.daemon import free_port, toml_config
from tests.support.ports import free_ports


def test_two_ranks_under_mlx_launch(tmp_path, tiny_models):
    port = free_port()
    config = tmp_path / "mlxd.toml"
    config.write_text(
        toml_config(
            server={"port": port},
            model={"path": str(tiny_models("llama"))},
            runtime={"blas": "off"},
            cluster={"backend": "ring", "join_timeout": 60.0},
        )
    )
    bindir = Path(sys.executable).parent
    cmd = [
        str(bindir / "mlx.launch"), "-n", "2", "--backend", "ring",
        # Rank r's ring port is the starting port + r: both claimed, not only the first.
        "--starting-port", str(free_ports(2)[0]), "--python", sys.executable,
        str(bindir / "mlxd"), "serve", "--config", str(config),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    log = open(tmp_path / "launch.log", "wb")  # noqa: SIM115
    # Its own process group: mlx.launch does not pass SIGTERM on to its ranks,
    # so the group is signalled as a whole (as systemd does with a unit's cgroup).
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                ready = httpx.get(f"{url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.3)
        text = (tmp_path / "launch.log").read_text(errors="replace")
        assert ready, text
        cluster = httpx.get(f"{url}/stats", timeout=10).json()["cluster"]
        assert cluster["world_size"] == 2 and cluster["state"] == "ready"
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [5, 17, 42], "max_tokens": 6}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher may be gone already
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    # Both ranks are gone (the launcher relays their output, so their last words may be lost).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _ranks_alive(config):
        time.sleep(0.2)
    assert not _ranks_alive(config)


def _ranks_alive(config: Path) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return any(str(config) in line and " serve " in line for line in ps.stdout.splitlines())
