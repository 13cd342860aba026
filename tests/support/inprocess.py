"""The real mlxd app served from inside the pytest process, for HTTP tests of protocol.

:class:`AppInProcess` is what ``mlxd serve`` builds for one machine (the same
settings from the same TOML file, the fleet with its real engine threads and
models, :class:`~mlxd.api.state.AppState`, the Litestar app behind the request
guard, mlxd's uvicorn protocol) on a real loopback port, served by uvicorn
from a background thread. It has the surface of
:class:`~tests.support.daemon.Daemon` the tests use (``url``, ``client()``,
``openai()``, ``stats()``, ``write_config``/``reload``, ``log()``, SIGHUP), so a
module whose subject is protocol (translation, rendering, validation) asks the
``apps`` fixture instead of ``daemons``, with the same config::

    @pytest.fixture(scope="module")
    def daemon(apps, tiny_models):
        return apps.get({"model": {"path": str(tiny_models("llama"))}})

What a process does (signals that stop it, exit codes, its port, stdout, its
memory) stays with :mod:`tests.support.daemons`, and so does the demo chat
model: a daemon re-executes itself onto an optimized BLAS and picks the demo's
dtype by it, which the pytest process does not (the demo model would run in
another dtype, slower). An app's ``log()`` holds what
mlxd logged in this process while the app ran, in the daemon's log format.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.api.state import AppState
from tests.support.daemon import Daemon, toml_config
from tests.support.daemons import DaemonPool, uses_demo_model

__all__ = ["AppInProcess", "Apps", "app_pool", "apps"]

# The environment switches an app in process understands (the rest of the
# environment is the process's own, shared by every app).
_SWITCHES = {"MLXD_FAULT_INJECTION"}


class _LogFile(logging.Handler):
    """mlxd's records, formatted as the daemon logs them, appended to one app's log file."""

    def __init__(self, path: Path):
        super().__init__()
        from mlxd.cli import LOG_FORMAT
        from mlxd.logs import EscapingFormatter

        self.setFormatter(EscapingFormatter(LOG_FORMAT))
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a bad record must not break the app
            self.handleError(record)
            return
        with self.lock or threading.Lock():
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()
        super().close()


class AppInProcess(Daemon):
    """One mlxd app (one machine) in this process, on its own loopback port and log."""

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
        unknown = set(env or {}) - _SWITCHES
        if unknown:
            raise ValueError(f"an app in process cannot take {sorted(unknown)}: use a daemon")
        super().__init__(workdir, config, env=env, args=args, name=name, port=port)
        self.faults = (env or {}).get("MLXD_FAULT_INJECTION") == "1"
        self.overrides: dict[str, Any] = {
            "server": {"port": self.port, "state_dir": self.env["MLXD_SERVER__STATE_DIR"]}
        }
        flags = list(self.args)
        while flags:
            flag = flags.pop(0)
            if flag != "--host" or not flags:
                raise ValueError(f"an app in process takes only --host, not {flag!r}")
            self.overrides["server"]["host"] = flags.pop(0)
        self.state: AppState | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._handler: _LogFile | None = None
        self._level: int | None = None

    # ------------------------------------------------------------ life

    def start(self, timeout: float = 300.0, *, wait_ready: bool = True) -> AppInProcess:
        from mlxd.assembly import runtime_info
        from mlxd.config import load_settings
        from mlxd.listen import bind
        from mlxd.server import make_server

        settings = load_settings(self.config_path, overrides=self.overrides)
        self._capture_log(settings.server.log_level)
        sock = bind(settings.server.host, self.port)
        self._server = make_server(
            settings,
            runtime_info(),
            config_path=self.config_path,
            overrides=self.overrides,
            faults=self.faults,
        )
        self.state = self._server.state
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name=f"uvicorn {self.url}", daemon=True
        )
        self._thread.start()
        if wait_ready:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop(timeout=10)
                raise
        return self

    def _serve(self, sock: Any) -> None:
        try:
            self._server.run(sockets=[sock])
        finally:
            sock.close()

    def _capture_log(self, level: str) -> None:
        self._handler = _LogFile(self.log_path)
        root = logging.getLogger()
        root.addHandler(self._handler)
        # The root logger's level, as the daemon sets it (and a reload changes it): a level
        # set on the "mlxd" logger would hide a reload's "debug" from mlxd's own records.
        wanted = logging.getLevelName(level.upper())
        if root.getEffectiveLevel() > wanted:
            self._level = root.level
            root.setLevel(wanted)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"the app's server thread ended:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"the app was not ready after {timeout}s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        """SIGHUP reloads the config, as the daemon's handler does; nothing else is sent."""
        if sig != signal.SIGHUP or self._server is None:
            raise ValueError(f"an app in process takes only SIGHUP, not {sig}")
        self._server.handle_exit(sig, None)

    def terminate(self) -> None:
        """Stop serving now: the app is discarded, so no open connection is waited for."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop uvicorn, then the engines (each on its own thread), then the log capture."""
        self.terminate()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.state is not None:
            self.state.fleet.stop()
        if self._handler is not None:
            logging.getLogger().removeHandler(self._handler)
            self._handler.close()
            self._handler = None
        if self._level is not None:
            logging.getLogger().setLevel(self._level)
            self._level = None
        return 0 if self._thread is None or not self._thread.is_alive() else None


class Apps:
    """One module's door to the pool (the ``apps`` fixture)."""

    def __init__(self, pool: DaemonPool, holder: str):
        self._pool = pool
        self._holder = holder

    def get(self, config: str | Mapping[str, Any], **options: Any) -> AppInProcess:
        """The app for ``config``; the demo chat model is served by daemons only."""
        text = config if isinstance(config, str) else toml_config(**config)
        if uses_demo_model(text):
            pytest.fail(f"{self._holder}: the demo chat model runs in a daemon (see inprocess)")
        app = self._pool.get(self._holder, text, **options)
        assert isinstance(app, AppInProcess)
        return app


_POOL = pytest.StashKey[DaemonPool]()


@pytest.fixture(scope="session")
def app_pool(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[DaemonPool]:
    """Every in-process app the modules asked for; all stopped when the session ends."""
    pool = DaemonPool(tmp_path_factory, kind=AppInProcess, prefix="app")
    pytestconfig.stash[_POOL] = pool
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def apps(app_pool: DaemonPool, request: pytest.FixtureRequest) -> Iterator[Apps]:
    """The factory of shared in-process apps for this module: ``apps.get(config, **options)``."""
    holder = request.module.__name__
    yield Apps(app_pool, holder)
    app_pool.release(holder)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    pool = config.stash.get(_POOL, None)
    if pool is not None and pool.started:
        terminalreporter.write_line(
            f"in-process apps: {pool.started} started, "
            f"{pool.reused} times a running one was handed to another module"
        )
