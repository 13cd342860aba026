"""Which BLAS serves ``cblas_sgemm`` in this process, read from ``/proc/self/maps``."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass

from mlxd.runtime.blas_libs import SYMBOL, classify, defines_cblas

# Thread getters, looked up in the already loaded library (never loaded by us).
_THREAD_GETTERS = {
    "openblas": "openblas_get_num_threads",
    "mkl": "mkl_get_max_threads",
    "blis": "bli_thread_get_num_threads",
}
_BLASLIKE_NAME = re.compile(r"blas|blis|mkl|atlas", re.IGNORECASE)


@dataclass(frozen=True)
class BlasInfo:
    """The BLAS library that serves ``cblas_sgemm`` in this process.

    Attributes:
        name: ``openblas``, ``mkl``, ``blis``, ``flexiblas``, ``atlas``, ``reference``,
            ``accelerate``, ``none`` (no BLAS loaded yet) or ``unknown``.
        path: The mapped file (symlinks resolved), or None.
        optimized: Whether this is a tuned implementation rather than netlib's.
        threads: Threads the library will use, when it can say; None otherwise.
    """

    name: str
    path: str | None
    optimized: bool
    threads: int | None


def mapped_files() -> list[tuple[int, int, str]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi, fields[5].rstrip("\n").removesuffix(" (deleted)")))
    return ranges


def global_cblas_provider() -> str | None:
    """The file that the global symbol scope (executable, LD_PRELOAD) resolves cblas_sgemm to.

    That scope is searched before MLX's own dependencies, so a library found here
    is the one MLX calls.
    """
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), SYMBOL), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None
    for lo, hi, path in mapped_files():
        if address is not None and lo <= address < hi:
            return path
    return None


def _threads(name: str, path: str) -> int | None:
    if name == "reference":
        return 1
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        return int(getattr(lib, _THREAD_GETTERS[name])())
    except (KeyError, AttributeError, OSError):
        return None


def mapped_blas() -> BlasInfo:
    """Reports the BLAS that this process actually uses, from ``/proc/self/maps``.

    Call it after ``import mlx.core``: before that, MLX's own BLAS is not mapped
    and the answer is ``none`` unless a BLAS was preloaded. A library in the
    global symbol scope (``LD_PRELOAD``) wins; otherwise the first mapped library
    that defines ``cblas_sgemm`` is reported. Libraries that merely contain
    "blas" in their name (such as NumPy's ``libscipy_openblas64_``, whose symbols
    are suffixed) are not counted.

    Returns:
        What serves ``cblas_sgemm``; ``accelerate`` on macOS, ``unknown`` on
        other systems without ``/proc``.
    """
    if sys.platform == "darwin":
        return BlasInfo("accelerate", "/System/Library/Frameworks/Accelerate.framework", True, None)
    if not sys.platform.startswith("linux"):
        return BlasInfo("unknown", None, False, None)
    path = global_cblas_provider()
    for mapped in dict.fromkeys(p for _, _, p in mapped_files()) if path is None else ():
        if _BLASLIKE_NAME.search(os.path.basename(mapped)) and defines_cblas(mapped):
            path = mapped
            break
    if path is None:
        return BlasInfo("none", None, False, None)
    name, optimized = classify(path)
    return BlasInfo(name, path, optimized, _threads(name, path))


def describe() -> dict[str, object]:
    """Summarizes the BLAS in use, for logs, ``/health`` and the dashboard.

    Returns:
        ``{"blas", "path", "optimized", "threads"}`` from :func:`mapped_blas`, plus
        ``"device"`` (``"cpu"``, ``"gpu"``) when MLX is already imported.
    """
    info = mapped_blas()
    out: dict[str, object] = {"blas": info.name, "path": info.path}
    out |= {"optimized": info.optimized, "threads": info.threads}
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        out["device"] = mx.default_device().type.name
    return out
