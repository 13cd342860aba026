"""The daemon process's resident memory, as the operating system counts it."""

from __future__ import annotations

import os
import resource
import sys


def rss() -> tuple[int | None, str]:
    """(bytes, label): the current RSS on Linux; the peak RSS elsewhere (macOS)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE"), "RSS"
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is bytes on macOS, KiB on the other Unixes.
    return (peak if sys.platform == "darwin" else peak * 1024), "peak RSS"
