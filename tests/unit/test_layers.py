"""House rule 1: layers by imports. The engine imports no web code; the HTTP
side and the dashboard import no MLX; nothing creates MLX state at import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

PKG = ROOT / "mlxd"
WEB = ("litestar", "uvicorn", "jinja2", "starlette", "httpx", "prometheus_client")
MLX = ("mlx", "mlx_lm")


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of nodes inside ``if TYPE_CHECKING:`` (imports for annotations only)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_only(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules_under(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize("path", modules_under("engine"), ids=lambda p: p.name)
def test_engine_imports_no_web_code(path):
    bad = {
        m
        for m in imported_modules(path)
        if m.split(".")[0] in WEB or m.startswith(("mlxd.api", "mlxd.dashboard"))
    }
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize(
    "path", modules_under("api") + modules_under("dashboard"), ids=lambda p: p.name
)
def test_http_side_imports_no_mlx_and_only_the_engines_face(path):
    """House rule 12: what the web side may use of the engine is ``mlxd.engine`` itself."""
    bad = {
        m
        for m in imported_modules(path)
        if m.split(".")[0] in MLX or (m.startswith("mlxd.engine.") and m != "mlxd.engine")
    }
    assert not bad, f"{path.name} imports {bad}; import them from the face, mlxd.engine"


@pytest.mark.parametrize("path", modules_under("api"), ids=lambda p: p.name)
def test_api_imports_nothing_above_it(path):
    """The dashboard and the app that composes both sit above the API: no import runs back up."""
    bad = {m for m in _mlxd_imports(path, None) if m.startswith(("mlxd.dashboard", "mlxd.web"))}
    assert not bad, f"{path.name} imports {bad}; compose them in mlxd.web"


def test_importing_the_http_side_loads_no_mlx():
    code = (
        "import sys, mlxd.engine, mlxd.web, mlxd.dashboard.page, mlxd.api.reload, mlxd.config,"
        " mlxd.cli;"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm'));"
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_importing_the_engine_creates_no_mlx_arrays():
    code = (
        "import gc, mlx.core as mx, mlxd.engine.chat.engine, mlxd.engine.chat.core,"
        " mlxd.engine.chat.loading, mlxd.engine.embeddings.engine, mlxd.engine.embeddings.loading;"
        "n = sum(isinstance(o, mx.array) for o in gc.get_objects()); print(n)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    baseline = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gc, mlx.core as mx, mlx_lm.generate;"
            "print(sum(isinstance(o, mx.array) for o in gc.get_objects()))",
        ],
        capture_output=True,
        text=True,
    )
    assert int(done.stdout) == int(baseline.stdout)


def _mlxd_imports(path: Path, modules: set[str] | None) -> set[str]:
    """The mlxd modules ``path`` imports anywhere (function bodies and TYPE_CHECKING too).

    With ``modules`` None, every name imported (not only the modules among ``modules``).
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found if modules is None else found & modules


def test_no_import_cycles_between_mlxd_modules() -> None:
    files = {
        ".".join(f.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): f
        for f in PKG.rglob("*.py")
    }
    graph = {m: _mlxd_imports(f, set(files)) - {m} for m, f in files.items()}
    cycles = []
    for start in graph:
        # Depth-first from each module: a path back to it is a cycle.
        stack = [(start, (start,))]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))
