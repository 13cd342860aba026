"""docs/design.md is the checked map of mlxd/ (house rule 14; datasette's ``test_docs.py``).

- Every module under ``mlxd/`` is named in docs/design.md by its path relative to
  ``mlxd/`` (``api/openai/render.py``, ``engine/chat/core.py``, ``cli.py``), as a whole
  path token: optionally written ``mlxd/...``, never as the tail of a longer path
  (``chat/core.py`` does not name ``engine/chat/core.py``). A module is every ``*.py``
  file except an ``__init__.py`` that holds nothing but a docstring: a package
  whose ``__init__`` carries code (a face, a version) is a module like any other.
- Every module has at most 400 lines (house rule 9).
- Every ``.py`` path docs/design.md names exists, relative to ``mlxd/`` (with or
  without the ``mlxd/`` prefix) or to the repository root (``tests/...``,
  ``benchmarks/...``): no stale entries, and no bare file names, which say
  nothing when three modules are called ``render.py``.

The tree is read when the tests run, so a module added, moved or grown shows up
as a failure that names it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "mlxd"
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 400


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return not body


def modules() -> list[str]:
    """Every module under mlxd/, as its path relative to mlxd/ (an empty package face exempt)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" and _docstring_only(path):
            continue
        found.append(path.relative_to(PACKAGE).as_posix())
    return found


MODULES = modules()
DOC = DESIGN.read_text()


def named(doc: str, module: str) -> bool:
    """Whether ``doc`` names ``module`` as a whole path token (``mlxd/`` prefix allowed)."""
    token = rf"(?<![\w./-])(?:mlxd/)?{re.escape(module)}(?![\w/-])"
    return re.search(token, doc) is not None


def mentioned_paths(doc: str) -> list[str]:
    """Every ``.py`` path the doc names, as written."""
    return sorted(set(re.findall(r"(?<![\w./-])([\w./-]*\w\.py)(?![\w/-])", doc)))


def resolves(path: str) -> bool:
    """A named path exists under mlxd/ (with or without its prefix) or the repository root."""
    inner = path.removeprefix("mlxd/")
    return (PACKAGE / inner).is_file() or (ROOT / path).is_file()


def test_the_tree_is_read():
    assert "engine/chat/core.py" in MODULES and "cli.py" in MODULES
    assert "engine/__init__.py" in MODULES  # the engine's face holds code
    assert "api/openai/__init__.py" not in MODULES  # an empty package marker


def test_the_token_rule():
    assert named("`api/openai/render.py` renders", "api/openai/render.py")
    assert named("see mlxd/engine/chat/core.py.", "engine/chat/core.py")
    assert not named("`render.py`", "api/openai/render.py")
    assert not named("`engine/chat/core.py`", "chat/core.py")
    assert not named("`engine/chat/core.pyx`", "engine/chat/core.py")
    assert mentioned_paths("`a/b.py`, mlxd/cli.py and `tests/unit/x.py`.") == [
        "a/b.py",
        "mlxd/cli.py",
        "tests/unit/x.py",
    ]


@pytest.mark.parametrize("module", MODULES)
def test_every_module_is_on_the_map(module: str):
    assert named(DOC, module), f"mlxd/{module} is not named in docs/design.md (as `{module}`)"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_is_small(module: str):
    lines = len((PACKAGE / module).read_text().splitlines())
    assert lines <= MAX_LINES, f"mlxd/{module} has {lines} lines (at most {MAX_LINES})"


def test_every_path_on_the_map_exists():
    paths = mentioned_paths(DOC)
    assert paths
    stale = [path for path in paths if not resolves(path)]
    assert not stale, (
        f"docs/design.md names paths that do not exist (write a module as its path "
        f"under mlxd/, a test by its path from the repository root): {stale}"
    )
