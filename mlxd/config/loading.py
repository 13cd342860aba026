"""Reading a config file into :class:`Settings`, and writing one back as TOML."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mlxd.config.issues import (
    ConfigError,
    ConfigIssue,
    _issues_from_validation,
    _line_of,
    parse_toml,
)
from mlxd.config.registry import registry_issues
from mlxd.config.settings import Settings, _toml_input


def load_settings(
    path: str | Path | None,
    *,
    text: str | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Settings:
    """Build settings from a TOML file, the environment and overrides.

    Args:
        path: The TOML file. ``None`` means defaults plus environment only.
        text: Use this text instead of reading ``path`` (the editor validates
            unsaved text this way); errors still name ``path``.
        overrides: Values that beat both the file and the environment, by
            section (``{"server": {"port": 9000}}``), e.g. from CLI flags.

    Raises:
        ConfigError: the file is missing, is not TOML, or fails validation.
    """
    source = str(path) if path is not None else "<defaults>"
    token = None
    if path is not None:
        path = Path(path)
        if text is None:
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                raise ConfigError(source, [ConfigIssue("", "file not found")]) from None
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(source, [ConfigIssue("", f"cannot read: {exc}")]) from None
        parse_toml(text, source)  # a readable error before pydantic sees it
        token = _toml_input.set((path, text))
    try:
        # pydantic validates the nested tables from plain dicts; the sources run in __init__.
        tables: dict[str, Any] = dict(overrides or {})
        settings = Settings(**tables)
    except ValidationError as exc:
        raise ConfigError(source, _issues_from_validation(exc, text)) from None
    finally:
        if token is not None:
            _toml_input.reset(token)
    issues = registry_issues(settings)
    if issues:
        raise ConfigError(source, [_placed(issue, text) for issue in issues])
    return settings


def _placed(issue: ConfigIssue, text: str | None) -> ConfigIssue:
    """``issue`` with the line its key is written on, else its table's line."""
    match = re.match(r"^\[([^\]]*)\](?: (.*))?$", issue.key)
    if match is None:
        return issue
    table, key = match.groups()
    loc = [p.strip().strip("\"'") for p in table.split(".") if p] + ([key] if key else [])
    line = _line_of(text, loc) or _line_of(text, loc[:-1] if key else loc)
    if line is None and text:  # a table of tables ([models]): its first sub-table
        prefix = f"[{table}."
        line = next(
            (n for n, raw in enumerate(text.splitlines(), 1) if raw.strip().startswith(prefix)),
            None,
        )
    return ConfigIssue(issue.key, issue.reason, line)


def dump_toml(settings: Settings, *, reveal_secrets: bool = False) -> str:
    """The effective config as TOML text (defaults filled in).

    Secrets are masked unless ``reveal_secrets``; unset optional keys are left
    out, since TOML has no null.
    """
    import tomli_w

    data = settings.model_dump(mode="json")
    if reveal_secrets:
        data["server"]["api_keys"] = [k.get_secret_value() for k in settings.server.api_keys]
        token = settings.server.admin_token
        data["server"]["admin_token"] = token.get_secret_value() if token else None
        for name, entry in settings.keys.items():
            if entry.key is not None:
                data["keys"][name]["key"] = entry.key.get_secret_value()
    return tomli_w.dumps(_drop_none(data))


def effective_toml(settings: Settings) -> str:
    """The effective config as a person reads it (``mlxd check-config``), secrets masked.

    :func:`dump_toml`, less what does not apply: the ``[model]`` table when a
    ``[models.<id>]`` registry replaces it, ``demo_dtype`` on an entry that
    is not the built-in demo model (it has a ``path``, or is an embedding
    model); and ``default`` as the registry resolves it (the one model of a
    kind is its default even when the file does not say so).
    """
    import tomli_w

    from mlxd.config.registry import default_id

    data = _drop_none(settings.model_dump(mode="json"))
    if settings.models:
        data.pop("model", None)
    for model_id, entry in data.get("models", {}).items():
        kind = entry.get("kind", "chat")
        entry["default"] = model_id == default_id(settings, kind)
        if entry.get("path") or entry.get("repo") or kind != "chat":
            entry.pop("demo_dtype", None)
    return tomli_w.dumps(data)


def _drop_none(value: Any) -> Any:
    """``value`` without None anywhere (TOML has no null), nor empty override tables."""
    if isinstance(value, dict):
        out = {k: _drop_none(v) for k, v in value.items() if v is not None}
        return {k: v for k, v in out.items() if v != {} or k == "models"}
    return value
