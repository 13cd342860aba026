"""Shared fixtures: tiny models per cache family, and helpers to run the real daemon."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest_tiny import tiny_loaded, tiny_model_path, tiny_models  # noqa: F401

CHROMIUM = os.environ.get("MLXD_CHROMIUM", "/usr/bin/chromium")


def require_browser() -> str:
    """The Chromium binary, or skip (fail under CI, where MLXD_REQUIRE_BROWSER=1)."""
    if Path(CHROMIUM).exists() or shutil.which(CHROMIUM):
        return CHROMIUM
    message = (
        f"Chromium not found at {CHROMIUM}: install Debian's 'chromium' package "
        "to run browser tests"
    )
    if os.environ.get("MLXD_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)
