"""CPU accounting: how busy the rest of a shared machine was during a wave."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("bench")


# The development machine is shared: other processes' CPU during a wave is
# measured (machine busy time minus the benchmark's own processes) and reported.

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (None off Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def process_cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of one process (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuWindow:
    """Measures the CPU that processes other than ``pids`` used over a window."""

    def __init__(self, *pids: int | str):
        self.pids = pids or ("self",)
        self.start = self._read()
        self.wall = time.monotonic()

    def _read(self) -> tuple[float | None, float]:
        return machine_cpu_s(), sum(process_cpu_s(p) for p in self.pids)

    def background_cores(self) -> float | None:
        (m0, own0), (m1, own1) = self.start, self._read()
        elapsed = time.monotonic() - self.wall
        if m0 is None or m1 is None or elapsed <= 0:
            return None
        return max(0.0, (m1 - m0) - (own1 - own0)) / elapsed


def cpu_busy(seconds: float = 2.0) -> float | None:
    """Fraction of the machine's CPUs busy over ``seconds`` (anyone's work)."""
    m0 = machine_cpu_s()
    time.sleep(seconds)
    m1 = machine_cpu_s()
    if m0 is None or m1 is None:
        return None
    return (m1 - m0) / seconds / (os.cpu_count() or 1)


def wait_for_idle(limit: float, timeout_s: float = 600.0) -> float | None:
    """Wait until the machine is at most ``limit`` busy (0..1); returns the last reading."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy()
    while busy is not None and busy > limit and time.monotonic() < deadline:
        logger.info(
            "machine %.0f%% busy (others' work); waiting for <= %.0f%%", busy * 100, limit * 100
        )
        busy = cpu_busy(5.0)
    return busy
