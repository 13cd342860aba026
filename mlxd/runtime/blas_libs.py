"""Finding and identifying BLAS libraries on disk (Linux), and how to install OpenBLAS.

Files are read, never loaded: see :mod:`mlxd.runtime.elf`.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from itertools import chain
from pathlib import Path

from mlxd.runtime.elf import own_ident, read_elf

SYMBOL = "cblas_sgemm"
# Matches the vanilla LP64 OpenBLAS builds, never ILP64 ones (libopenblas64*):
# preloading those would hand 64-bit integers to code that passes 32-bit ones.
_OPENBLAS_NAME = re.compile(r"^libopenblas(p|o|_pthreads|_openmp|_serial)?\.so(\.\d+)*$")


def defines_cblas(path: str | os.PathLike[str]) -> bool:
    elf = read_elf(path)
    return elf is not None and elf.ident == own_ident() and SYMBOL in elf.defined


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
        if defines_cblas(path):
            return path
    return None


def classify(path: str) -> tuple[str, bool]:
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
