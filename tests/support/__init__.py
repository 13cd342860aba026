"""What the tests share: the daemon factory, the tiny models, engine and cluster helpers."""

from __future__ import annotations

from pathlib import Path

# The repository's root (the folder of pyproject.toml).
ROOT = Path(__file__).resolve().parents[2]
