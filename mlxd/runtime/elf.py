"""Reading an ELF shared library's header and dynamic symbols without loading it.

Symbols are checked by reading the ELF dynamic symbol table instead of dlopen():
loading OpenBLAS runs its constructors (CPU probing, a thread pool sized from
the environment we are about to change) in a process that may not re-exec.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Elf:
    ident: tuple[int, int, int]  # (class, byte order, machine)
    defined: frozenset[str]  # defined dynamic function symbols
    needed: tuple[str, ...]  # DT_NEEDED entries


def read_elf(path: str | os.PathLike[str]) -> Elf | None:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse_elf(m)
    except (OSError, ValueError, IndexError, struct.error):
        return None


def _parse_elf(m: mmap.mmap) -> Elf | None:
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
    return Elf(ident, frozenset(defined), tuple(needed))


@cache
def own_ident() -> tuple[int, int, int] | None:
    elf = read_elf("/proc/self/exe") or read_elf(sys.executable)
    return elf.ident if elf else None
