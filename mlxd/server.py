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

from mlxd.api.access import exposure_warning
from mlxd.api.app import make_app
from mlxd.api.guard import RequestGuard
from mlxd.api.metrics import install_metrics
from mlxd.api.protocol import make_protocol
from mlxd.api.state import AppState
from mlxd.config import Settings
from mlxd.dashboard.routes import route_handlers
from mlxd.engine.engine import Engine

logger = logging.getLogger(__name__)


def runtime_info() -> dict[str, Any]:
    """What the process actually runs on (read after MLX is loaded)."""
    from mlxd.engine.model import device_name
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
        await super().serve(sockets)

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
        engine = state.engine
        state.shutting_down = True
        await asyncio.wrap_future(engine.call(lambda core: setattr(core, "accepting", False)))
        timeout = state.settings.server.shutdown_timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and engine.snapshot().busy:
            await asyncio.sleep(0.1)
        if engine.snapshot().busy:
            logger.warning(
                "shutdown_timeout (%.0fs) passed: ending the remaining requests", timeout
            )
            await asyncio.wrap_future(
                engine.call(
                    lambda core: core.abort_all(
                        "the server shut down before this request finished "
                        f"(shutdown_timeout {timeout:g}s)"
                    )
                )
            )
            await asyncio.sleep(0.2)  # let the error events reach their streams
        self.should_exit = True


def warn_if_exposed(settings: Settings) -> None:
    message = exposure_warning(settings)
    if message:
        logger.warning("SECURITY: %s", message)


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background task failed", exc_info=task.exception())


def serve(settings: Settings, *, config_path: Path | None, overrides: dict[str, Any]) -> int:
    """Run the daemon until a signal stops it. Returns the exit code."""
    runtime = runtime_info()
    logger.info(
        "runtime: %s, BLAS %s%s",
        runtime["device"],
        runtime["blas"],
        f" ({runtime['blas_path']})" if runtime["blas_path"] else "",
    )
    faults = os.environ.get("MLXD_FAULT_INJECTION") == "1"
    engine = Engine(
        settings,
        optimized_blas=bool(runtime["blas_optimized"]),
        fault_injection=faults,
        config_source=str(config_path) if config_path else None,
        runtime=runtime,
    )
    state = AppState(
        engine=engine,
        settings=settings,
        config_path=config_path,
        overrides=overrides,
        fault_injection=faults,
    )
    install_metrics(state)
    app = make_app(state, extra_route_handlers=route_handlers())
    engine.start()
    host, port = settings.server.host, settings.server.port
    config = uvicorn.Config(
        RequestGuard(app, lambda: state.settings),
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
    logger.info("mlxd %s listening on http://%s:%d", "starting,", shown, port)
    logger.info(
        "dashboard: http://%s:%d/dashboard  OpenAI base URL: http://%s:%d/v1",
        shown,
        port,
        shown,
        port,
    )
    try:
        server.run()
    finally:
        engine.stop()
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
