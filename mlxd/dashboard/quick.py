"""The editor's quick controls: the few keys an operator changes most, as form fields.

Global keys (a section and a key) for every config, and each ``[models.<id>]``
entry's ``pin`` and ``keep_alive`` when the config has a registry.
"""

from __future__ import annotations

import re
from typing import Any

import tomlkit

from mlxd.config import Settings

_BOOL = ("false", "true")

# (key, label, kind, hint); kind "int", "size", "text" or a tuple of choices.
QUICK: tuple[tuple[str, str, Any, str], ...] = (
    ("batch.size", "Batch size", "int", "1 runs every request serially"),
    ("batch.kv_budget", "KV budget", "size", '"auto", or a size such as 512MiB'),
    ("batch.prompt_concurrency", "Prompt concurrency", "int", "prompts prefilled together"),
    ("lanes.logprobs", "logprobs", ("batch", "serial"), "lane for requests with logprobs"),
    ("lanes.penalties", "penalties", ("batch", "serial"), "lane for sampling penalties"),
    ("lanes.logit_bias", "logit_bias", ("batch", "serial"), "lane for requests with a logit_bias"),
    (
        "memory.budget",
        "Memory budget",
        "size",
        '"auto", or a size such as 24GiB: weights, KV and prompt caches of every model',
    ),
    ("scheduling.preempt", "Preemption", _BOOL, "an urgent request may pause a bulk row"),
)
# Each [models.<id>] entry's own keys: (name, label, kind, hint).
PER_MODEL: tuple[tuple[str, str, Any, str], ...] = (
    ("pin", "pin", _BOOL, "loaded at start and never unloaded"),
    ("keep_alive", "keep_alive", "text", 'unload after this long idle: "30m", "2h", "forever"'),
)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:g}s"  # keep_alive in seconds
    return str(value)


def quick_values(settings: Settings) -> dict[str, str]:
    """What each quick control shows for these settings."""
    dumped = settings.model_dump(mode="json")
    out = {}
    for key, *_ in QUICK:
        section, name = key.split(".")
        out[key] = _shown(dumped[section][name])
    for model_id, entry in settings.models.items():
        for name, *_ in PER_MODEL:
            out[f"models.{model_id}.{name}"] = _shown(getattr(entry, name))
    return out


def _spec(key: str) -> tuple[str, Any, str, tuple[str, ...]] | None:
    """A key's label, kind, hint and path in the document; None for no quick control."""
    for quick_key, label, kind, hint in QUICK:
        if key == quick_key:
            return label, kind, hint, tuple(key.split("."))
    if key.startswith("models."):
        model_id, _, name = key.removeprefix("models.").rpartition(".")
        for own, label, kind, hint in PER_MODEL:
            if name == own and model_id:
                return f"{model_id}: {label}", kind, hint, ("models", model_id, name)
    return None


def quick_controls(values: dict[str, str] | None) -> list[dict[str, Any]]:
    values = values or {}
    keys = [key for key, *_ in QUICK]
    keys += [k for k in values if k.startswith("models.") and _spec(k) is not None]
    controls = []
    for key in keys:
        spec = _spec(key)
        assert spec is not None
        label, kind, hint, _ = spec
        controls.append(
            {
                "key": key,
                "id": "q-" + re.sub(r"[^A-Za-z0-9_-]", "-", key),
                "label": label,
                "hint": hint,
                "kind": kind if isinstance(kind, str) else "choice",
                "choices": kind if isinstance(kind, tuple) else (),
                "value": values.get(key, ""),
            }
        )
    return controls


def _typed(kind: Any, raw: str) -> Any:
    """An integer or a bool where one is meant; anything else stays text for validation."""
    raw = raw.strip()
    if kind == _BOOL and raw in _BOOL:
        return raw == "true"
    return int(raw) if kind in ("int", "size") and re.fullmatch(r"-?\d+", raw) else raw


def quick_edit(
    text: str, submitted: dict[str, str], shown: dict[str, str]
) -> tuple[str, list[str]]:
    """``text`` with the quick controls that differ from what was shown written in.

    The document is edited in place with tomlkit: only the lines of the changed
    keys change (a key the file does not set yet is added to its table, a
    missing section at the end); comments, order and formatting are kept, an
    inline comment after a changed value included. ``text`` must be a valid config.
    """
    doc = tomlkit.parse(text)
    changed = []
    for key in shown:
        spec = _spec(key)
        raw = submitted.get(key)
        if spec is None or raw is None or raw.strip() == shown.get(key):
            continue
        _, kind, _, path = spec
        table: Any = doc
        for part in path[:-1]:
            if part not in table:
                if table is not doc:
                    break  # a model the file does not name (an override): not written
                table.add(tomlkit.nl())
                table.add(part, tomlkit.table())
            table = table[part]
        else:
            table[path[-1]] = _typed(kind, raw)
            changed.append(key)
    return (tomlkit.dumps(doc) if changed else text), changed
