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

import ctypes
import importlib.util
import logging
import mmap
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import chain
from pathlib import Path

log = logging.getLogger(__name__)

REEXEC_GUARD = "MLXD_BLAS_REEXEC"
"""Set in the environment of the re-executed process so it never re-executes again."""

_SYMBOL = "cblas_sgemm"
# Thread getters, looked up in the already loaded library (never loaded by us).
_THREAD_GETTERS = {
    "openblas": "openblas_get_num_threads",
    "mkl": "mkl_get_max_threads",
    "blis": "bli_thread_get_num_threads",
}
# Matches the vanilla LP64 OpenBLAS builds, never ILP64 ones (libopenblas64*):
# preloading those would hand 64-bit integers to code that passes 32-bit ones.
_OPENBLAS_NAME = re.compile(r"^libopenblas(p|o|_pthreads|_openmp|_serial)?\.so(\.\d+)*$")
_BLASLIKE_NAME = re.compile(r"blas|blis|mkl|atlas", re.IGNORECASE)


class BlasError(RuntimeError):
    """The ``blas`` setting cannot be honoured (bad path, not a BLAS library)."""


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


# --- ELF reading --------------------------------------------------------------
# Symbols are checked by reading the ELF dynamic symbol table instead of dlopen():
# loading OpenBLAS runs its constructors (CPU probing, a thread pool sized from
# the environment we are about to change) in a process that may not re-exec.


@dataclass(frozen=True)
class _Elf:
    ident: tuple[int, int, int]  # (class, byte order, machine)
    defined: frozenset[str]  # defined dynamic function symbols
    needed: tuple[str, ...]  # DT_NEEDED entries


def _read_elf(path: str | os.PathLike[str]) -> _Elf | None:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse_elf(m)
    except (OSError, ValueError, IndexError, struct.error):
        return None


def _parse_elf(m: mmap.mmap) -> _Elf | None:
    if m[:4] != b"\x7fELF" or m[4] not in (1, 2) or m[5] not in (1, 2):
        return None
    is64, end = m[4] == 2, "<" if m[5] == 1 else ">"
    machine = struct.unpack_from(end + "H", m, 18)[0]
    ident = (m[4], m[5], machine)
    shoff, shentsize, shnum = struct.unpack_from(end + ("40xQ10xHH" if is64 else "32xI10xHH"), m, 0)
    # (type, offset, size, link, entsize) for each section header.
    shfmt = end + ("4xI16xQQI12xQ" if is64 else "4xI8xIII8xI")
    sections = [struct.unpack_from(shfmt, m, shoff + i * shentsize) for i in range(shnum)]

    def cstr(table: int, offset: int) -> str:
        start = sections[table][1] + offset
        return m[start : m.find(b"\0", start)].decode(errors="replace")

    defined: set[str] = set()
    needed: list[str] = []
    symfmt = end + ("IB1xH16x" if is64 else "I8xB1xH")
    for kind, offset, size, link, entsize in sections:
        if kind == 11 and entsize:  # SHT_DYNSYM
            for pos in range(offset + entsize, offset + size, entsize):
                name, info, shndx = struct.unpack_from(symfmt, m, pos)
                if shndx != 0 and info & 0xF in (2, 10):  # defined STT_FUNC / STT_GNU_IFUNC
                    defined.add(cstr(link, name))
        elif kind == 6 and entsize:  # SHT_DYNAMIC
            for pos in range(offset, offset + size, entsize):
                tag, val = struct.unpack_from(end + ("qQ" if is64 else "iI"), m, pos)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(cstr(link, val))
    return _Elf(ident, frozenset(defined), tuple(needed))


@cache
def _own_ident() -> tuple[int, int, int] | None:
    elf = _read_elf("/proc/self/exe") or _read_elf(sys.executable)
    return elf.ident if elf else None


def _defines_cblas(path: str | os.PathLike[str]) -> bool:
    elf = _read_elf(path)
    return elf is not None and elf.ident == _own_ident() and _SYMBOL in elf.defined


# --- finding and identifying libraries ---------------------------------------


def _candidates() -> list[Path]:
    multiarch = {sysconfig.get_config_var("MULTIARCH"), f"{platform.machine()}-linux-gnu"}
    # Debian, Ubuntu; the bare libopenblas.so.0 is the update-alternatives choice.
    subdirs = ("openblas-pthread/", "openblas-openmp/", "", "openblas-serial/")
    paths = [
        f"/usr/lib/{a}/{d}libopenblas.so.0" for a in sorted(multiarch - {None}) for d in subdirs
    ]
    paths += [
        "/usr/lib64/libopenblasp.so.0",  # Fedora, RHEL: pthreads build
        "/usr/lib64/libopenblaso.so.0",  # OpenMP build
        "/usr/lib64/libopenblas_pthreads.so.0",  # openSUSE
        "/usr/lib64/libopenblas.so.0",  # Fedora serial build, openSUSE alternatives
        "/usr/lib/libopenblas.so.0",  # Arch, Alpine
        "/usr/lib/libopenblas.so",
    ]
    return [Path(p) for p in paths]


def _ldconfig_candidates() -> list[Path]:
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    # Lines look like "\tlibopenblas.so.0 (libc6,x86-64) => /lib/x86_64-linux-gnu/libopenblas.so.0".
    entries = (line.strip().partition(" => ") for line in out.splitlines())
    return [Path(t) for name, _, t in entries if _OPENBLAS_NAME.match(name.split(" ")[0])]


def find_system_blas() -> Path | None:
    """Finds a system OpenBLAS that can serve MLX's ``cblas_sgemm``.

    Known distribution paths are tried first (pthreads builds before OpenMP and
    serial ones), then ``ldconfig -p``. A candidate qualifies if its ELF header
    matches this interpreter's architecture and its dynamic symbol table defines
    ``cblas_sgemm``; the file is read, never loaded.

    Returns:
        The library path (unresolved, so it survives package upgrades), or None
        if there is none or this is not Linux.
    """
    if not sys.platform.startswith("linux"):
        return None
    seen: set[str] = set()
    for path in chain.from_iterable(f() for f in (_candidates, _ldconfig_candidates)):
        real = os.path.realpath(path)
        if real in seen or not path.is_file():
            continue
        seen.add(real)
        if _defines_cblas(path):
            return path
    return None


def _classify(path: str) -> tuple[str, bool]:
    file = Path(path.lower())
    # The directory counts too: Debian ships OpenBLAS as openblas-pthread/libblas.so.3.
    for part in (file.name, file.parent.name):
        for key in ("openblas", "mkl", "blis", "flexiblas", "atlas"):
            if key in part:
                # FlexiBLAS dispatches to a backend; distributions default it to OpenBLAS.
                return key, True
    if re.match(r"libc?blas[-.]", file.name):
        return "reference", False
    return "unknown", False


def _mapped_files() -> list[tuple[int, int, str]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi, fields[5].rstrip("\n").removesuffix(" (deleted)")))
    return ranges


def _global_cblas_provider() -> str | None:
    """The file that the global symbol scope (executable, LD_PRELOAD) resolves cblas_sgemm to.

    That scope is searched before MLX's own dependencies, so a library found here
    is the one MLX calls.
    """
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), _SYMBOL), ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None
    for lo, hi, path in _mapped_files():
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
    path = _global_cblas_provider()
    for mapped in dict.fromkeys(p for _, _, p in _mapped_files()) if path is None else ():
        if _BLASLIKE_NAME.search(os.path.basename(mapped)) and _defines_cblas(mapped):
            path = mapped
            break
    if path is None:
        return BlasInfo("none", None, False, None)
    name, optimized = _classify(path)
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


# --- install hint --------------------------------------------------------------

_HINTS = (
    (("debian", "ubuntu"), "sudo apt-get install libopenblas0-pthread"),
    # Fedora's plain "openblas" package is the serial build; -threads adds libopenblasp.
    (("fedora", "rhel", "centos"), "sudo dnf install openblas-threads"),
    (("arch",), "sudo pacman -S openblas"),
    (("opensuse", "suse", "sles"), "sudo zypper install libopenblas_pthreads0"),
    (("alpine",), "apk add openblas"),
)


def install_hint(os_release: str | os.PathLike[str] | None = None) -> str | None:
    """Returns the command that installs OpenBLAS on this distribution.

    Args:
        os_release: An os-release file to read instead of ``/etc/os-release``
            (``/usr/lib/os-release`` as the fallback).

    Returns:
        One shell command, or None on macOS and on unrecognized distributions.
    """
    if sys.platform == "darwin":
        return None
    files = [os_release] if os_release is not None else ["/etc/os-release", "/usr/lib/os-release"]
    fields: dict[str, str] = {}
    for file in files:
        try:
            lines = Path(file).read_text().splitlines()
        except OSError:
            continue
        for key, sep, value in (line.partition("=") for line in lines):
            if sep and not key.lstrip().startswith("#"):
                fields[key.strip()] = value.strip().strip("\"'")
        break
    ids = [fields.get("ID", ""), *fields.get("ID_LIKE", "").split()]
    for distro in (i.lower() for i in ids if i):
        for names, command in _HINTS:
            if any(distro == n or distro.startswith(n + "-") for n in names):
                return command
    return None


# --- re-exec -----------------------------------------------------------------


def _mlx_links_optimized_blas() -> bool:
    # Finding the spec does not import mlx (a namespace package).
    spec = importlib.util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        elf = _read_elf(Path(root, "lib", "libmlx.so"))
        if elf is not None:
            return any(_classify(n)[1] for n in elf.needed)
    return False


def _explicit_library(setting: str) -> Path:
    path = Path(setting).expanduser().absolute()
    if not path.is_file():
        raise BlasError(
            f"blas = {setting!r}: no such file. Use 'auto', 'off' or the path of a BLAS "
            "shared library such as /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
        )
    if not _defines_cblas(path):
        raise BlasError(
            f"blas = {setting!r} is not a {platform.machine()} shared library that "
            f"defines {_SYMBOL}; MLX would not use it"
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
        if keyword != "off" and _global_cblas_provider() is None:
            log.warning(
                "LD_PRELOAD=%s did not provide %s (see the loader's message above); "
                "MLX keeps its bundled reference BLAS",
                os.environ.get("LD_PRELOAD", ""),
                _SYMBOL,
            )
        return
    if keyword == "off":
        return
    if explicit is not None:
        if any(os.path.realpath(explicit) == p for _, _, p in _mapped_files()):
            return
        library = explicit
    else:
        provider = _global_cblas_provider()
        if (provider and _classify(provider)[1]) or _mlx_links_optimized_blas():
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
