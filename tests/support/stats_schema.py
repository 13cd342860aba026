"""docs/api.md as the schema of ``/stats``: field tables read as ``path -> type``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.support import ROOT

API_DOC = ROOT / "docs" / "api.md"


def documented_fields(doc: Path = API_DOC) -> dict[str, str]:
    """``path -> type`` from the tables of ``doc`` (docs/api.md)."""
    fields = {}
    for match in re.finditer(r"^\| `([^`]+)` \| `([^`]+)` \|", doc.read_text(), re.M):
        fields[match.group(1)] = match.group(2).replace("\\|", "|")
    assert len(fields) > 50, "docs/api.md lost its tables"
    return fields


def type_ok(value: Any, spec: str) -> bool:
    for option in (o.strip() for o in spec.split("|")):
        if option == "null" and value is None:
            return True
        if option == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if option == "str" and isinstance(value, str):
            return True
        if option == "bool" and isinstance(value, bool):
            return True
        if (option == "object" or option.startswith("like ")) and isinstance(value, dict):
            return True
        if option == "map[str, int]" and isinstance(value, dict):
            return all(type_ok(v, "int") for v in value.values())
        if option.startswith("list[") and isinstance(value, list):
            item = option[5:-1]
            return all(type_ok(v, item) for v in value)
    return False


def check_schema(stats: dict[str, Any], fields: dict[str, str], seen: set[str]) -> None:
    """Every field of ``stats`` is documented with the right type; collect paths into ``seen``."""

    def walk(obj: dict[str, Any], prefix: str) -> None:
        for key, value in obj.items():
            path = prefix + key
            assert path in fields, f"/stats has {path!r}, which docs/api.md does not list"
            assert type_ok(value, fields[path]), f"{path} = {value!r} is not {fields[path]}"
            seen.add(path)
            if fields[path].startswith("map"):
                continue
            if fields[path].startswith("like "):
                # An object with another field's fields (fleet.models[].engine.prompt_cache).
                walk(value, fields[path][5:] + ".")
                continue
            if isinstance(value, dict):
                walk(value, path + ".")
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, dict):
                        walk(item, path + "[].")

    walk(stats, "")
