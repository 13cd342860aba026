"""The Jinja2 environment of ``templates/``, shared by the dashboard and the editor."""

from __future__ import annotations

from functools import cache
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from litestar import MediaType, Response

from mlxd.api.ops.stats import NO_STORE
from mlxd.paths import templates_dir


@cache
def environment() -> Environment:
    """The Jinja2 environment of ``templates/``; autoescape is on for everything."""
    return Environment(
        loader=FileSystemLoader(templates_dir()),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, status_code: int = 200, **context: Any) -> Response[str]:
    html = environment().get_template(template).render(**context)
    return Response(html, status_code=status_code, media_type=MediaType.HTML, headers=NO_STORE)
