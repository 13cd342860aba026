"""The headless Chromium the dashboard tests drive (through Playwright)."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = os.environ.get("MLXD_CHROMIUM", "/usr/bin/chromium")
# Headless flags for Debian's Chromium as root on a machine with no network
# beyond loopback (no background connections, no first-run work).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


def require_browser() -> str:
    """The Chromium binary, or skip (fail under CI, where MLXD_REQUIRE_BROWSER=1)."""
    for candidate in (CHROMIUM, "chromium", "chromium-browser", "google-chrome"):
        found = candidate if os.access(candidate, os.X_OK) else shutil.which(candidate)
        if found:
            return found
    message = (
        f"Chromium not found (tried {CHROMIUM}, chromium, chromium-browser, google-chrome): "
        "install Debian's 'chromium' package to run browser tests"
    )
    if os.environ.get("MLXD_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)
