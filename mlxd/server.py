"""The composition root: settings, engines, app and uvicorn, wired together for the process's role.

A process has one of three roles (:func:`serve`): one machine, a cluster's
rank 0, or a cluster follower. Also where the process meets its supervisor: SIGTERM/SIGINT shut down
gracefully (new requests get 503, in-flight ones finish for up to
``server.shutdown_timeout`` seconds, then the rest end with an error and the
process exits 0; a second signal exits at once), SIGHUP reloads the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from mlxd.address import remove_record, url_for, write_record
from mlxd.api.http.access import exposure_warning
from mlxd.api.http.guard import RequestGuard
from mlxd.api.http.protocol import make_protocol
from mlxd.api.ops.memory import start_from_env
from mlxd.api.state import AppState
from mlxd.assembly import build_state, faults_enabled, runtime_info
from mlxd.config import Settings
from mlxd.engine import Failed
from mlxd.listen import ListenError, bind
from mlxd.process import EXIT_REFUSED
from mlxd.web import ERROR_ENVELOPES, make_app

if TYPE_CHECKING:
    from mlxd.engine.cluster.join import Membership
    from mlxd.engine.cluster.leader import Leader

logger = logging.getLogger(__name__)


class MlxdServer(uvicorn.Server):
    """uvicorn with mlxd's signal semantics (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: AppState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown_started = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        fleet = asyncio.ensure_future(self.state.fleet.run())
        fleet.add_done_callback(_log_task_error)
        batches = self.state.batches
        if batches is not None:
            await batches.start()
        try:
            await super().serve(sockets)
        finally:
            if batches is not None:
                await batches.stop()
            fleet.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        loop = self._loop
        if sig == signal.SIGHUP:
            if loop is not None:
                loop.call_soon_threadsafe(self._spawn, self._reload())
            return
        if self._shutdown_started:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(1)
        self._shutdown_started = True
        logger.info("%s received: shutting down gracefully", signal.Signals(sig).name)
        if loop is None:
            self.should_exit = True
        else:
            loop.call_soon_threadsafe(self._spawn, self._graceful_shutdown())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_log_task_error)

    async def _reload(self) -> None:
        from mlxd.api.reload import reload_from_file

        await reload_from_file(self.state, trigger="SIGHUP")

    async def _graceful_shutdown(self) -> None:
        state = self.state
        engines = [e for e in state.fleet.engines() if e.alive]
        state.shutting_down = True
        # Requests waiting for a model to load get their 503 now, not after the load.
        state.fleet.refuse_waiting(
            Failed(
                "shutting_down",
                "The server is shutting down; retry on another instance or later.",
                503,
            )
        )
        for engine in engines:
            await asyncio.wrap_future(engine.stop_accepting())
        timeout = state.settings.server.shutdown_timeout
        deadline = time.monotonic() + timeout

        def busy() -> bool:
            return any(e.snapshot().busy for e in engines)

        while time.monotonic() < deadline and busy():
            await asyncio.sleep(0.1)
        if busy():
            logger.warning(
                "shutdown_timeout (%.0fs) passed: ending the remaining requests", timeout
            )
            message = (
                f"the server shut down before this request finished (shutdown_timeout {timeout:g}s)"
            )
            for engine in engines:
                await asyncio.wrap_future(engine.abort_all(message))
            await asyncio.sleep(0.2)  # let the error events reach their streams
        self.should_exit = True


def warn_if_exposed(settings: Settings) -> None:
    message = exposure_warning(settings)
    if message:
        logger.warning("SECURITY: %s", message)


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background task failed", exc_info=task.exception())


# ---------------------------------------------------------------- the roles


def serve(settings: Settings, *, config_path: Path | None, overrides: dict[str, Any]) -> int:
    """Run the daemon in the role its settings give it until it stops; returns the exit code.

    One machine without ``[cluster]``; with it, rank 0 serves HTTP for the
    group and every other rank follows rank 0's plans (docs/cluster.md). A
    role that serves HTTP binds its port first: a busy port fails at once,
    before the model loads.
    """
    if settings.cluster is None:
        return serve_alone(settings, config_path=config_path, overrides=overrides)
    from mlxd.engine.cluster.join import ClusterError, membership

    try:
        member = membership(settings.cluster)
    except ClusterError as exc:
        logger.error("cluster: %s", exc)
        return EXIT_REFUSED
    if member.rank != 0:
        return serve_follower(settings, member)
    return serve_rank0(settings, member, config_path=config_path, overrides=overrides)


def serve_alone(settings: Settings, *, config_path: Path | None, overrides: dict[str, Any]) -> int:
    """One machine: HTTP and every configured model."""
    sock = _listen(settings)
    if sock is None:
        return EXIT_REFUSED
    record = _record_address(settings, sock, config_path)
    try:
        runtime = _prepare(config_path)
        return _run_http(settings, sock, runtime, config_path=config_path, overrides=overrides)
    finally:
        remove_record(record)


def serve_rank0(
    settings: Settings, member: Membership, *, config_path: Path | None, overrides: dict[str, Any]
) -> int:
    """A cluster's rank 0: HTTP and the one model, whose engine leads the group."""
    from mlxd.engine.cluster.join import http_port_clash
    from mlxd.engine.cluster.leader import Leader

    assert settings.cluster is not None
    sock = _listen(settings)
    if sock is None:
        return EXIT_REFUSED
    clash = http_port_clash(member, settings.server.host, sock.getsockname()[1])
    if clash is not None:
        logger.error("cluster: %s", clash)
        sock.close()
        return EXIT_REFUSED
    record = _record_address(settings, sock, config_path)
    try:
        runtime = _prepare(config_path)
        leader = Leader(settings.cluster, member)
        logger.info("cluster rank 0 of %s: serving HTTP for the group", member.world)
        return _run_http(
            settings, sock, runtime, config_path=config_path, overrides=overrides, leader=leader
        )
    finally:
        remove_record(record)


def serve_follower(settings: Settings, member: Membership) -> int:
    """A cluster rank other than 0: no HTTP (it binds nothing), it applies rank 0's plans."""
    from mlxd.engine.cluster.follower import run_follower

    runtime = runtime_info()
    logger.info(
        "cluster rank %d of %s: no HTTP on this rank; runtime %s, BLAS %s",
        member.rank,
        member.world,
        runtime["device"],
        runtime["blas"],
    )
    return run_follower(
        settings, member, optimized_blas=bool(runtime["blas_optimized"]), faults=faults_enabled()
    )


# ---------------------------------------------------------------- shared setup


def _listen(settings: Settings) -> socket.socket | None:
    """The port, bound first: a busy port fails at once, before the model loads."""
    try:
        return bind(settings.server.host, settings.server.port)
    except ListenError as exc:
        logger.error("%s", exc)
        return None


def _record_address(
    settings: Settings, sock: socket.socket, config_path: Path | None
) -> Path | None:
    """Where this daemon really listens (flags included), for ``mlxd status``/``reload``."""
    url = url_for(settings.server.host, sock.getsockname()[1])
    return write_record(settings.server.state_path, config_path, url)


def _prepare(config_path: Path | None) -> dict[str, Any]:
    """Tidy the config's folder and log what the process runs on; returns the runtime facts."""
    if config_path is not None:
        from mlxd.dashboard.configfile import clean_stray_temps

        for stray in clean_stray_temps(config_path):
            logger.info("removed %s, left by an interrupted config write", stray)
    runtime = runtime_info()
    logger.info(
        "runtime: %s, BLAS %s%s",
        runtime["device"],
        runtime["blas"],
        f" ({runtime['blas_path']})" if runtime["blas_path"] else "",
    )
    return runtime


def _run_http(
    settings: Settings,
    sock: socket.socket,
    runtime: dict[str, Any],
    *,
    config_path: Path | None,
    overrides: dict[str, Any],
    leader: Leader | None = None,
) -> int:
    """Build the fleet, the app and uvicorn on the bound socket; serve until a signal."""
    server = make_server(
        settings,
        runtime,
        config_path=config_path,
        overrides=overrides,
        faults=faults_enabled(),
        leader=leader,
    )
    state = server.state
    warn_if_exposed(settings)
    _log_addresses(settings.server.host, settings.server.port)
    try:
        server.run(sockets=[sock])
    finally:
        state.fleet.stop()
    return 0 if server.started or server.should_exit else 1


def make_server(
    settings: Settings,
    runtime: dict[str, Any],
    *,
    config_path: Path | None,
    overrides: dict[str, Any],
    faults: bool,
    leader: Leader | None = None,
) -> MlxdServer:
    """One machine's state and app under uvicorn, the fleet started: serve it with ``run``.

    What the daemon serves, and what the tests serve in process (tests/support/inprocess.py).
    """
    start_from_env()  # MLXD_TRACEMALLOC: allocation sites for /admin/memory
    state = build_state(
        settings,
        runtime,
        config_path=config_path,
        overrides=overrides,
        faults=faults,
        leader=leader,
    )
    app = make_app(state)
    state.fleet.start()
    return MlxdServer(_uvicorn_config(app, state), state)


def _uvicorn_config(app: Any, state: AppState) -> uvicorn.Config:
    """uvicorn for ``app``: the request guard around it, mlxd's protocol and timeouts."""
    server = state.settings.server
    return uvicorn.Config(
        RequestGuard(app, lambda: state.settings, ERROR_ENVELOPES),
        http=make_protocol(lambda: state.settings.limits.header_timeout),
        host=server.host,
        port=server.port,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
    )


def _log_addresses(host: str, port: int) -> None:
    shown = f"[{host}]" if ":" in host else host
    logger.info("mlxd listening on http://%s:%d (the model loads meanwhile)", shown, port)
    logger.info(
        "dashboard: http://%s:%d/dashboard  OpenAI base URL: http://%s:%d/v1",
        shown,
        port,
        shown,
        port,
    )
