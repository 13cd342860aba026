"""The composition root: settings, engine, app and uvicorn, wired together.

Also where the process meets its supervisor: SIGTERM/SIGINT shut down
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
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from mlxd.api.app import ERROR_ENVELOPES, make_app
from mlxd.api.http.access import exposure_warning
from mlxd.api.http.guard import RequestGuard
from mlxd.api.http.protocol import make_protocol
from mlxd.api.ops.metrics import install_metrics
from mlxd.api.ops.recent import install_recent
from mlxd.api.state import AppState
from mlxd.config import Settings
from mlxd.dashboard import logtail
from mlxd.engine.chat.engine import Engine
from mlxd.listen import ListenError, bind

logger = logging.getLogger(__name__)


def runtime_info() -> dict[str, Any]:
    """What the process actually runs on (read after MLX is loaded)."""
    from mlxd.engine.chat.loading import device_name
    from mlxd.runtime.blas import mapped_blas

    info = mapped_blas()
    return {
        "device": device_name(),
        "blas": info.name,
        "blas_path": info.path,
        "blas_optimized": info.optimized,
        "blas_threads": info.threads,
        "pid": os.getpid(),
    }


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
        try:
            await super().serve(sockets)
        finally:
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
        from mlxd.reload import reload_from_file

        await reload_from_file(self.state, trigger="SIGHUP")

    async def _graceful_shutdown(self) -> None:
        state = self.state
        engines = [e for e in state.fleet.engines() if e.alive]
        state.shutting_down = True
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


def _leave_after_loss(state: AppState, message: str, code: int) -> None:
    """The cluster is lost: refuse new requests, let error events flush, exit ``code``.

    A supervisor (systemd, launchd) then restarts the group; no collective
    can be trusted again in this process.
    """
    state.shutting_down = True
    logger.error("cluster lost (%s); exiting with status %d", message, code)

    def leave() -> None:
        time.sleep(1.0)
        exit_now(code)

    threading.Thread(target=leave, name="mlxd-exit", daemon=True).start()


def warn_if_exposed(settings: Settings) -> None:
    message = exposure_warning(settings)
    if message:
        logger.warning("SECURITY: %s", message)


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background task failed", exc_info=task.exception())


def _follow(settings: Settings, member: Any) -> int:
    """A cluster rank other than 0: no HTTP, apply rank 0's plans (docs/cluster.md)."""
    from mlxd.engine.cluster.follower import run_follower

    runtime = runtime_info()
    logger.info(
        "cluster rank %d of %s: no HTTP on this rank; runtime %s, BLAS %s",
        member.rank,
        member.world,
        runtime["device"],
        runtime["blas"],
    )
    faults = os.environ.get("MLXD_FAULT_INJECTION") == "1"
    return run_follower(
        settings, member, optimized_blas=bool(runtime["blas_optimized"]), faults=faults
    )


def serve(settings: Settings, *, config_path: Path | None, overrides: dict[str, Any]) -> int:
    """Run the daemon until a signal stops it. Returns the exit code.

    The port is bound first: a busy port fails at once, before MLX and the
    model load.
    """
    host, port = settings.server.host, settings.server.port
    member = None
    if settings.cluster is not None:
        from mlxd.engine.cluster.join import ClusterError, membership

        try:
            member = membership(settings.cluster)
        except ClusterError as exc:
            logger.error("cluster: %s", exc)
            return 2
        if member.rank != 0:  # a follower serves no HTTP: it binds nothing
            return _follow(settings, member)
    try:
        sock = bind(host, port)
    except ListenError as exc:
        logger.error("%s", exc)
        return 2
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
    faults = os.environ.get("MLXD_FAULT_INJECTION") == "1"
    leader = None
    if settings.cluster is not None and member is not None:
        from mlxd.engine.cluster.leader import Leader

        leader = Leader(settings.cluster, member)
        logger.info("cluster rank 0 of %s: serving HTTP for the group", member.world)
    optimized = bool(runtime["blas_optimized"])
    state: AppState | None = None

    def make_engine(model_settings: Settings, model_id: str, pool: Any, at_start: bool) -> Engine:
        engine = Engine(
            model_settings,
            optimized_blas=optimized,
            fault_injection=faults,
            runtime=runtime,
            cluster=leader,
            pool=pool,
            model_id=model_id,
            load_at_start=at_start,
        )
        engine.on_fatal = lambda message, code: _leave_after_loss(state, message, code)
        return engine

    def make_embedding(model_settings: Settings, model_id: str) -> Any:
        from mlxd.engine.embeddings.engine import EmbeddingEngine

        return EmbeddingEngine(model_settings, model_id, optimized_blas=optimized)

    from mlxd.engine.chat.loading import device_memory_bytes
    from mlxd.engine.fleet.fleet import Fleet

    fleet = Fleet(
        settings,
        device_bytes=device_memory_bytes(),
        make_engine=make_engine,
        make_embedding=make_embedding,
    )
    state = AppState(
        fleet=fleet,
        settings=settings,
        config_path=config_path,
        overrides=overrides,
        fault_injection=faults,
    )
    install_metrics(state)
    install_recent(state)
    logtail.install()
    app = make_app(state)
    fleet.start()
    config = uvicorn.Config(
        RequestGuard(app, lambda: state.settings, ERROR_ENVELOPES),
        http=make_protocol(lambda: state.settings.limits.header_timeout),
        host=host,
        port=port,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
    )
    server = MlxdServer(config, state)
    warn_if_exposed(settings)
    shown = f"[{host}]" if ":" in host else host
    logger.info("mlxd listening on http://%s:%d (the model loads meanwhile)", shown, port)
    logger.info(
        "dashboard: http://%s:%d/dashboard  OpenAI base URL: http://%s:%d/v1",
        shown,
        port,
        shown,
        port,
    )
    try:
        server.run(sockets=[sock])
    finally:
        fleet.stop()
    return 0 if server.started or server.should_exit else 1


def exit_now(code: int) -> None:
    """Leave without interpreter teardown, once everything is flushed.

    The engine has stopped and released its MLX objects; skipping teardown
    keeps MLX's static destructors from racing objects Python frees late
    (seen as "terminate called without an active exception").
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
