"""The model registry: ``[models.<id>]`` tables, or the one ``[model]`` table.

A config names its models either with one ``[model]`` table (the original
form: one model, loaded at start and never evicted) or with a
``[models.<id>]`` table per model. :func:`registry` gives both the same
shape, an ordered ``{id: ModelEntry}``, and :func:`for_model` the settings
one model runs with: the global sections, overridden by the entry's own
``batch``, ``lanes``, ``sampling`` and ``prompt_cache`` tables.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from mlxd.config.entry import OVERRIDABLE, ModelEntry
from mlxd.config.issues import ConfigIssue
from mlxd.config.sections import ModelSettings

if TYPE_CHECKING:
    from mlxd.config.settings import Settings

# What a [models.<id>] table's name may be: what clients send as "model".
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
DEMO_MODEL_ID = "SmolLM2-135M-Instruct"  # mlxd.demo.DEMO_MODEL_ID, without importing it


def single_id(model: ModelSettings) -> str:
    """The id of the model a ``[model]`` table serves (what mlx-lm's loader names it)."""
    if model.name:
        return model.name
    if model.path:
        return Path(model.path).expanduser().resolve().name
    if model.repo:
        return model.repo
    return DEMO_MODEL_ID


def registry(settings: Settings) -> dict[str, ModelEntry]:
    """Every configured model by id, in the file's order.

    A ``[models.<id>]`` chat entry with no ``path`` (the built-in demo model)
    also answers as ``SmolLM2-135M-Instruct``, the id it had under ``[model]``,
    unless another entry has that id or alias: moving the demo model into the
    registry (the README's embedding recipe) keeps clients' model id working.
    """
    if settings.models:
        return _with_demo_alias(dict(settings.models))
    model = settings.model
    entry = ModelEntry(**model.model_dump(), default=True, pin=True)
    return {single_id(model): entry}


def _with_demo_alias(entries: dict[str, ModelEntry]) -> dict[str, ModelEntry]:
    if DEMO_MODEL_ID in entries or any(
        DEMO_MODEL_ID in e.aliases or any(fnmatch.fnmatchcase(DEMO_MODEL_ID, a) for a in e.aliases)
        for e in entries.values()
    ):
        return entries
    for model_id, entry in entries.items():
        if entry.kind == "chat" and entry.path is None:
            aliases = [*entry.aliases, DEMO_MODEL_ID]
            entries[model_id] = entry.model_copy(update={"aliases": aliases})
            break
    return entries


def registry_notes(old: Settings, new: Settings) -> list[str]:
    """What a reload's model changes mean for clients: an id gone or renamed, a pin lost."""
    before, after = registry(old), registry(new)
    notes = []
    for model_id, entry in before.items():
        successor = model_id if model_id in after else resolve(new, model_id, entry.kind)
        if successor is None:
            notes.append(
                f"model {model_id} is no longer configured: requests naming it get 404 "
                "model_not_found (add it to a model's aliases to keep the name)"
            )
            continue
        if successor != model_id:
            notes.append(f"model {model_id} is now served as {successor} (it answers as an alias)")
        if entry.pin and not after[successor].pin:
            keep = after[successor].keep_alive
            notes.append(
                f"{successor} is no longer pinned: it loads on its first request and unloads "
                f"after keep_alive ({keep if isinstance(keep, str) else f'{keep:g}s'}) idle; "
                "set pin = true in its table to keep it loaded"
            )
    return notes


def for_model(settings: Settings, model_id: str) -> Settings:
    """The settings ``model_id`` runs with: its entry as ``model``, its overrides applied."""
    entry = registry(settings)[model_id]
    update: dict[str, Any] = {"model": entry.model_copy(update={"name": model_id})}
    for name, section in OVERRIDABLE.items():
        own = getattr(entry, name).model_dump(exclude_none=True)
        if own:
            merged = {**getattr(settings, name).model_dump(), **own}
            update[name] = section.model_validate(merged)
    return settings.model_copy(update=update)


def default_id(settings: Settings, kind: str = "chat") -> str | None:
    """The model a request that names none gets: the entry marked default, else the first."""
    entries = [(i, e) for i, e in registry(settings).items() if e.kind == kind]
    for model_id, entry in entries:
        if entry.default:
            return model_id
    return entries[0][0] if entries else None


def resolve(settings: Settings, name: str | None, kind: str = "chat") -> str | None:
    """The id ``name`` (an id or an alias; empty for the default) stands for, or None.

    An exact id wins, then an exact alias, then the first alias pattern
    (fnmatch, in the file's order) that matches.
    """
    if not name:
        return default_id(settings, kind)
    entries = registry(settings)
    if name in entries:
        return name
    for model_id, entry in entries.items():
        if name in entry.aliases:
            return model_id
    for model_id, entry in entries.items():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in entry.aliases):
            return model_id
    return None


def registry_issues(settings: Settings) -> list[ConfigIssue]:
    """What is wrong with the registry as a whole (each entry is valid on its own)."""
    issues: list[ConfigIssue] = []
    models = settings.models
    if not models:
        return issues
    if "model" in settings.model_fields_set:
        issues.append(
            ConfigIssue(
                "[model]",
                "use either one [model] table or [models.<id>] tables, not both "
                "(move it to [models.<id>])",
            )
        )
    owners: dict[str, str] = {}
    defaults: dict[str, list[str]] = {}
    for model_id, entry in models.items():
        where = f"[models.{model_id}]"
        if not MODEL_ID.match(model_id):
            issues.append(
                ConfigIssue(
                    where,
                    "a model id is letters, digits and . _ : / @ + - (at most 128, "
                    "starting with a letter or digit)",
                )
            )
        if entry.name is not None and entry.name != model_id:
            issues.append(
                ConfigIssue(
                    f"{where} name",
                    f"the table's name is the model id ({model_id!r}); "
                    "drop name, or list other names in aliases",
                )
            )
        no_demo = ("rerank", "transcription", "speech")  # kinds with no built-in model
        if entry.kind in no_demo and not entry.path:
            issues.append(
                ConfigIssue(f"{where} path", f'a kind = "{entry.kind}" model needs a path')
            )
        if entry.default:
            defaults.setdefault(entry.kind, []).append(model_id)
        for alias in entry.aliases:
            if alias in models and alias != model_id:
                issues.append(
                    ConfigIssue(f"{where} aliases", f"{alias!r} is the id of another model")
                )
            elif alias in owners and owners[alias] != model_id:
                issues.append(
                    ConfigIssue(
                        f"{where} aliases",
                        f"{alias!r} is already an alias of [models.{owners[alias]}]",
                    )
                )
            owners.setdefault(alias, model_id)
        issues.extend(_override_issues(settings, model_id, entry))
    if not any(e.kind == "chat" for e in models.values()):
        issues.append(
            ConfigIssue("[models]", 'the registry needs at least one kind = "chat" model')
        )
    for kind, ids in defaults.items():
        if len(ids) > 1:
            issues.append(
                ConfigIssue(
                    f"[models.{ids[1]}] default",
                    f"only one {kind} model may be the default ({', '.join(ids)} are)",
                )
            )
    if settings.cluster is not None:
        chats = [i for i, e in models.items() if e.kind == "chat"]
        if len(models) > 1:
            issues.append(
                ConfigIssue(
                    "[cluster]",
                    f"a cluster serves exactly one chat model; this config has {len(models)} "
                    f"({', '.join(models)})",
                )
            )
        elif not chats:
            issues.append(ConfigIssue("[cluster]", "a cluster serves a chat model"))
    return issues


def _override_issues(settings: Settings, model_id: str, entry: ModelEntry) -> list[ConfigIssue]:
    """What an entry's override tables break once merged over the global sections."""
    issues = []
    for name, section in OVERRIDABLE.items():
        own = getattr(entry, name).model_dump(exclude_none=True)
        if not own:
            continue
        try:
            section.model_validate({**getattr(settings, name).model_dump(), **own})
        except ValidationError as exc:
            for error in exc.errors():
                message = str(error["msg"]).removeprefix("Value error, ")
                issues.append(ConfigIssue(f"[models.{model_id}] {name}", message))
    return issues


def describe(settings: Settings) -> list[str]:
    """The effective registry, a line per model (``mlxd check-config``)."""
    lines = []
    for model_id, entry in registry(settings).items():
        flags = [entry.kind]
        if model_id == default_id(settings, entry.kind):
            flags.append("default")
        if entry.pin:
            flags.append("pinned")
        keep = entry.keep_alive
        flags.append("keep_alive " + (keep if isinstance(keep, str) else f"{keep:g}s"))
        own = [
            f"{name}.{key}={value}"
            for name in OVERRIDABLE
            for key, value in getattr(entry, name).model_dump(exclude_none=True).items()
        ]
        where = (
            entry.path
            or (entry.repo and f"{entry.repo}@{entry.repo_revision}")
            or ("built-in demo model")
        )
        line = f"  {model_id}: {where} ({', '.join(flags)})"
        if entry.aliases:
            line += f"; aliases {', '.join(entry.aliases)}"
        if own:
            line += f"; overrides {', '.join(own)}"
        lines.append(line)
    return lines
