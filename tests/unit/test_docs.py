"""Docs are tested: every route the app serves is in docs/api.md, every test file
is on docs/testing.md's map; the docs name only files that exist."""

from __future__ import annotations

import re

from mlxd.api.state import AppState
from mlxd.config import Settings
from mlxd.engine.chat.engine import Engine
from mlxd.engine.fleet.fleet import Fleet
from mlxd.web import make_app
from tests.support import ROOT


def _engine(settings, model_id, pool, at_start):
    return Engine(settings, pool=pool, model_id=model_id, load_at_start=at_start)


API = (ROOT / "docs" / "api.md").read_text()


def served_routes() -> set[tuple[str, str]]:
    fleet = Fleet(Settings(), device_bytes=2**30, make_engine=_engine)  # never started
    app = make_app(AppState(fleet, Settings()))
    routes = set()
    for route in app.routes:
        path = re.sub(r"\{(\w+):[^}]+\}", r"{\1}", route.path)
        for method in sorted(getattr(route, "methods", ())):
            if method not in ("HEAD", "OPTIONS"):
                routes.add((method, path))
    return routes


def documented(method: str, path: str) -> bool:
    if f"`{method} {path}`" in API:
        return True
    # a documented parameterised route covers its concrete instances
    for doc_method, doc_path in re.findall(r"`(GET|POST|PUT|DELETE) (/[^`]*)`", API):
        if doc_method == method and re.fullmatch(
            re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(doc_path)), path
        ):
            return True
    return False


def test_every_route_is_documented_in_api_md():
    missing = sorted(f"{m} {p}" for m, p in served_routes() if not documented(m, p))
    assert not missing, f"routes missing from docs/api.md: {missing}"


def test_the_core_routes_exist():
    routes = served_routes()
    for route in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/ready"),
        ("GET", "/stats"),
        ("GET", "/metrics"),
        ("POST", "/admin/reload"),
        ("GET", "/dashboard"),
    ]:
        assert route in routes


def test_relative_links_in_docs_and_readme_point_to_files():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken


def test_every_test_file_is_on_the_testing_map():
    """docs/testing.md names each test file (in its layer's table) and each support module."""
    doc = (ROOT / "docs" / "testing.md").read_text()
    files = sorted((ROOT / "tests").glob("*/test_*.py"))
    support = sorted(p for p in (ROOT / "tests" / "support").glob("*.py") if p.stem != "__init__")
    assert files and support
    missing = [str(p.relative_to(ROOT)) for p in [*files, *support] if f"`{p.name}`" not in doc]
    assert not missing, f"not on docs/testing.md's map: {missing}"
    for path in files:
        assert f"### `tests/{path.parent.name}`" in doc, f"no section for tests/{path.parent.name}"
