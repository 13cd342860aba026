"""Optimized CPU BLAS for MLX on Linux.

The ``mlx-cpu`` wheel links a bundled netlib *reference* BLAS, so f32 matmuls on
the CPU backend run one to two orders of magnitude slower than with OpenBLAS.
MLX resolves ``cblas_sgemm`` through the dynamic linker, so a system OpenBLAS in
``LD_PRELOAD`` takes precedence. ``LD_PRELOAD`` is only read when a process
starts, hence :func:`ensure_blas` re-executes the daemon once, before MLX is
imported. Nothing here applies on macOS, where MLX uses Metal and Accelerate.

This module must not import MLX: it runs before MLX is loaded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

from mlxd.runtime.blas_libs import (
    SYMBOL,
    classify,
    defines_cblas,
    find_system_blas,
    install_hint,
)
from mlxd.runtime.blas_mapped import (
    BlasInfo,
    describe,
    global_cblas_provider,
    mapped_blas,
    mapped_files,
)
from mlxd.runtime.elf import read_elf

__all__ = [
    "REEXEC_GUARD",
    "BlasError",
    "BlasInfo",
    "describe",
    "ensure_blas",
    "find_system_blas",
    "install_hint",
    "mapped_blas",
]

log = logging.getLogger(__name__)

REEXEC_GUARD = "MLXD_BLAS_REEXEC"
"""Set in the environment of the re-executed process so it never re-executes again."""


class BlasError(RuntimeError):
    """The ``blas`` setting cannot be honoured (bad path, not a BLAS library)."""


# --- re-exec -----------------------------------------------------------------


def _mlx_links_optimized_blas() -> bool:
    # Finding the spec does not import mlx (a namespace package).
    spec = importlib.util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        elf = read_elf(Path(root, "lib", "libmlx.so"))
        if elf is not None:
            return any(classify(n)[1] for n in elf.needed)
    return False


def _explicit_library(setting: str) -> Path:
    path = Path(setting).expanduser().absolute()
    if not path.is_file():
        raise BlasError(
            f"blas = {setting!r}: no such file. Use 'auto', 'off' or the path of a BLAS "
            "shared library such as /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
        )
    if not defines_cblas(path):
        raise BlasError(
            f"blas = {setting!r} is not a {platform.machine()} shared library that "
            f"defines {SYMBOL}; MLX would not use it"
        )
    return path


def _started_as_script(script: str) -> bool:
    """Whether the kernel ran ``script`` through its ``#!`` line (``mlxd serve``).

    Such a process is named after the script (``/proc/self/comm``), which ``pgrep``,
    ``killall`` and ``top`` show; re-executing the script keeps that name.
    """
    try:
        comm = Path("/proc/self/comm").read_text().rstrip("\n")
        with open(script, "rb") as f:
            shebang = f.read(2) == b"#!"
    except OSError:
        return False
    return shebang and os.access(script, os.X_OK) and comm == os.path.basename(script)[:15]


def _reexec_command(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """The program and argument vector that restart this program, or None."""
    script = sys.argv[0]
    if not sys.executable or script in ("", "-"):  # interactive, or a script on stdin
        return None
    if _started_as_script(script):
        return script, [script, *argv[1:]]
    # sys.orig_argv is [python, *options, script | -c code | -m module, *sys.argv[1:]].
    orig, n_args = list(sys.orig_argv), len(sys.argv) - 1
    if n_args and orig[-n_args:] != sys.argv[1:]:
        return sys.executable, [sys.executable, "-m", "mlxd", *argv[1:]]
    prefix = orig[: len(orig) - n_args]
    # sys.executable, not orig[0]: a bare "python" would be looked up on PATH again
    # by the new interpreter and could find another one (outside the venv).
    return sys.executable, [sys.executable, *prefix[1:], *argv[1:]]


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours taskset/cpusets, unlike cpu_count()
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _reexec_env(library: Path, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    previous = env.get("LD_PRELOAD", "").strip()
    env["LD_PRELOAD"] = f"{library}:{previous}" if previous else str(library)
    if "OPENBLAS_NUM_THREADS" not in env and (
        threads is not None or not {"GOTO_NUM_THREADS", "OMP_NUM_THREADS"} & env.keys()
    ):
        env["OPENBLAS_NUM_THREADS"] = str(threads or _default_threads())
    env[REEXEC_GUARD] = "1"
    return env


def ensure_blas(setting: str, threads: int | None, argv: Sequence[str]) -> None:
    """Re-executes the process once with an optimized BLAS preloaded (Linux only).

    Call it first thing in the CLI, before anything imports MLX. On success this
    function does not return: the process image is replaced by the same command
    line (same PID, environment kept) with ``LD_PRELOAD``, ``OPENBLAS_NUM_THREADS``
    (unless the user set it or ``OMP_NUM_THREADS``) and :data:`REEXEC_GUARD` set.

    Args:
        setting: ``"auto"`` (find a system OpenBLAS), ``"off"``, or the path of
            the BLAS shared library to preload.
        threads: OpenBLAS threads; None means the CPUs this process may run on.
        argv: The program's ``sys.argv``-style vector; ``argv[1:]`` is passed on.

    Raises:
        BlasError: ``setting`` is a path that is missing or is not a BLAS library.
        ValueError: ``threads`` is below 1.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"blas threads must be >= 1, got {threads}")
    keyword = setting.strip().lower()
    if not sys.platform.startswith("linux"):
        if keyword not in ("auto", "off"):
            log.warning("blas = %r is ignored on %s", setting, sys.platform)
        return
    # A bad path is a configuration error even when nothing would be preloaded.
    explicit = None if keyword in ("auto", "off") else _explicit_library(setting)
    if os.environ.get(REEXEC_GUARD):
        if keyword != "off" and global_cblas_provider() is None:
            log.warning(
                "LD_PRELOAD=%s did not provide %s (see the loader's message above); "
                "MLX keeps its bundled reference BLAS",
                os.environ.get("LD_PRELOAD", ""),
                SYMBOL,
            )
        return
    if keyword == "off":
        return
    if explicit is not None:
        if any(os.path.realpath(explicit) == p for _, _, p in mapped_files()):
            return
        library = explicit
    else:
        provider = global_cblas_provider()
        if (provider and classify(provider)[1]) or _mlx_links_optimized_blas():
            return  # preloaded already (by the user, a systemd unit) or not needed
        library = find_system_blas()
        if library is None:
            hint = install_hint()
            log.warning(
                "no optimized BLAS found; MLX CPU matmuls use the slow reference BLAS. %s",
                f"Install OpenBLAS: {hint}" if hint else "Install OpenBLAS (libopenblas.so.0).",
            )
            return
    if "mlx.core" in sys.modules:
        log.warning("mlx is already imported; not preloading %s (set it in LD_PRELOAD)", library)
        return
    command = _reexec_command(argv)
    if command is None:
        log.warning("cannot re-execute this interpreter session; not preloading %s", library)
        return
    log.info("re-executing with LD_PRELOAD=%s", library)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.execve(*command, _reexec_env(library, threads))
