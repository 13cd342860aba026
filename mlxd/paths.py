"""Where the dashboard's templates and static files live.

In a checkout (an editable install) they sit at the top of the repository,
one place to edit them; a wheel ships them inside the package as
``mlxd/templates`` and ``mlxd/static`` (see ``pyproject.toml``). The packaged
copy wins when both exist, so a wheel never reads a stray checkout.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _locate(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"mlxd cannot find its {name}/ directory (looked in {_PACKAGE / name} and "
        f"{_PACKAGE.parent / name}); reinstall mlxd"
    )


def templates_dir() -> Path:
    """The Jinja2 templates: ``mlxd/templates`` in a wheel, ``templates/`` in a checkout."""
    return _locate("templates")


def static_dir() -> Path:
    """htmx and the stylesheet: ``mlxd/static`` in a wheel, ``static/`` in a checkout."""
    return _locate("static")
