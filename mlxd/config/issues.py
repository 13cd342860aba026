"""What is wrong with a config file, and where: issues with keys and line numbers."""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # pyright: ignore[reportMissingImports] - installed on 3.10 only


@dataclass(frozen=True)
class ConfigIssue:
    """One thing wrong with a config: where, and why."""

    key: str
    reason: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{where}{self.key}: {self.reason}" if self.key else f"{where}{self.reason}"


class ConfigError(Exception):
    """A config file that cannot be used. ``str()`` names the file, keys and reasons."""

    def __init__(self, source: str, issues: list[ConfigIssue]):
        self.source = source
        self.issues = issues
        lines = "\n".join(f"  {issue}" for issue in issues)
        super().__init__(f"invalid config {source}:\n{lines}")


_TOML_LINE = re.compile(r"\(at line (\d+), column \d+\)")


def _issues_from_validation(exc: ValidationError, text: str | None = None) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal["))]
        key = ".".join(loc)
        if len(loc) >= 3 and loc[0] == "models":
            key = f"[{'.'.join(loc[:-1])}] {loc[-1]}"
        elif len(loc) >= 2:
            key = f"[{loc[0]}] {'.'.join(loc[1:])}"
        if err["type"] == "extra_forbidden":
            reason = "unknown key" if len(loc) >= 2 else "unknown section or top-level key"
            known = _known_keys(loc[:-1])
            near = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            if near:
                reason += f"; did you mean {near[0]!r}?"
            if known:
                reason += f" (known: {', '.join(known)})"
        else:
            reason = err["msg"].removeprefix("Value error, ")
            given = err.get("input")
            secret = loc[:2] in (["server", "api_keys"], ["server", "admin_token"]) or (
                loc[:1] == ["keys"] and loc[-1:] == ["key"]
            )
            if not secret and not isinstance(given, dict) and "(got " not in reason:
                reason += f" (got {given!r})"
        issues.append(ConfigIssue(key=key, reason=reason, line=_line_of(text, loc)))
    return issues


# --- where a key is written (for error messages) -------------------------------
_TABLE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_.\-\"' ]+?)\s*=")


def _line_of(text: str | None, loc: list[str]) -> int | None:
    """The 1-based line of the TOML text that sets ``loc`` (section, key), if one does.

    A plain scan (tables, ``key =`` and dotted ``section.key =`` lines), enough
    to point at a key in a config file; None when it cannot tell.
    """
    if not text or not loc:
        return None
    table: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        if match := _TABLE.match(raw):
            table = [p.strip().strip("\"'") for p in match.group(1).split(".")]
            if table == loc:
                return number
            continue
        if match := _KEY.match(raw):
            key = [p.strip().strip("\"'") for p in match.group(1).split(".")]
            full = table + key
            n = min(len(full), len(loc))  # a list's item is on its key's line
            if n > len(table) and full[:n] == loc[:n]:
                return number
    return None


# --- end of where a key is written ---------------------------------------------


def _known_keys(parent: list[str]) -> list[str]:
    from mlxd.config.entry import ModelEntry
    from mlxd.config.settings import SECTIONS

    if not parent:
        return [*SECTIONS, "models", "keys"]
    if parent[0] == "keys" and len(parent) == 2:
        from mlxd.config.keys import KeyEntry

        return list(KeyEntry.model_fields)
    if parent[0] == "models" and len(parent) >= 2:
        if len(parent) == 2:
            return list(ModelEntry.model_fields)
        section = SECTIONS.get(parent[2]) if len(parent) == 3 else None
        return list(section.model_fields) if section else []
    section = SECTIONS.get(parent[0])
    return list(section.model_fields) if section and len(parent) == 1 else []


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """Parse TOML text, raising :class:`ConfigError` with the line on failure."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_LINE.search(str(exc))
        line = int(match.group(1)) if match else None
        raise ConfigError(source, [ConfigIssue("", f"invalid TOML: {exc}", line)]) from exc
