"""Start the real ``mlxd serve`` in a subprocess on a free port, for HTTP tests.

The daemon is exactly what a user runs (``python -m mlxd serve --config ...``),
including the BLAS re-exec on Linux; tests talk to it over real sockets with
httpx and the ``openai`` package.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.ports import free_port

# Every daemon a test started; any still running when pytest exits is killed,
# so a failed test never leaves a server behind.
_STARTED: list[Daemon] = []


@atexit.register
def _kill_leftovers() -> None:
    for daemon in _STARTED:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()


class Daemon:
    """One ``mlxd serve`` process with its own config file and log."""

    def __init__(
        self,
        workdir: Path,
        config: str,
        *,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        name: str = "mlxd",
        port: int | None = None,
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "mlxd.toml"
        self.config_path.write_text(config, encoding="utf-8")
        self.log_path = self.workdir / f"{name}.log"
        # A port given here is expected in the config file; otherwise --port picks a free one.
        self.port_flag = port is None
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # Its own state (the prompt cache's disk tier): nothing leaks between daemons,
        # and a restart of this one finds what it left.
        state = (env or {}).get("MLXD_SERVER__STATE_DIR") or str(self.workdir / "state")
        self.env["MLXD_SERVER__STATE_DIR"] = state
        # A PYTHONPATH of the test's own goes first; the one the tests run under
        # (a checkout other than the installed one) stays behind it.
        paths = [(env or {}).get("PYTHONPATH"), os.environ.get("PYTHONPATH")]
        if any(paths):
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.args = args or []
        self.proc: subprocess.Popen | None = None
        self._terminated = False

    def start(self, timeout: float = 300.0, *, wait_ready: bool = True) -> Daemon:
        cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(self.config_path)]
        if self.port_flag:
            cmd += ["--port", str(self.port)]
        cmd += self.args
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._terminated = False
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        _STARTED.append(self)
        if wait_ready:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop(timeout=10)
                raise
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlxd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # a start is ~2 s: a coarse poll adds a tenth of one on average
        raise TimeoutError(f"mlxd was not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)

    def openai(self, **kw: Any):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), **kw)

    def async_openai(self, **kw: Any):
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), **kw
        )

    def write_config(self, text: str) -> None:
        self.config_path.write_text(text, encoding="utf-8")

    def reload(self) -> httpx.Response:
        return httpx.post(f"{self.url}/admin/reload", timeout=120)

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/stats", timeout=10).json()

    def wait_rows(self, n: int, *, tokens: int = 1, timeout: float = 60.0) -> None:
        """Wait until ``n`` rows decode, each with at least ``tokens`` tokens generated."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.stats()["rows"]
            if len(rows) >= n and all(r["generated_tokens"] >= tokens for r in rows):
                return
            time.sleep(0.02)
        raise AssertionError(f"{n} rows never decoded: {self.stats()}")

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until nothing runs or waits; return that /stats snapshot."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats()
            if not s["busy"]:
                return s
            time.sleep(0.05)
        raise AssertionError(f"the daemon did not go idle: {self.stats()}")

    def model_id(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def alive(self) -> bool:
        """Whether the daemon's process runs (a test may have killed it)."""
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """Send SIGTERM once, without waiting (a second SIGTERM makes mlxd exit at once)."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def toml_config(**sections: dict[str, Any]) -> str:
    """A config file's text from ``section={key: value}`` keyword arguments."""
    import tomli_w

    return tomli_w.dumps({k: v for k, v in sections.items() if v})
