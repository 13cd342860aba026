"""The editor's quick controls: the few keys an operator changes most, as form fields."""

from __future__ import annotations

import re
from typing import Any

import tomlkit

from mlxd.config import Settings

# (key, label, kind, hint); kind "int", "size" or a tuple of choices.
QUICK: tuple[tuple[str, str, Any, str], ...] = (
    ("batch.size", "Batch size", "int", "1 runs every request serially"),
    ("batch.kv_budget", "KV budget", "size", '"auto", or a size such as 512MiB'),
    ("batch.prompt_concurrency", "Prompt concurrency", "int", "prompts prefilled together"),
    ("lanes.logprobs", "logprobs", ("batch", "serial"), "lane for requests with logprobs"),
    ("lanes.penalties", "penalties", ("batch", "serial"), "lane for sampling penalties"),
    ("lanes.logit_bias", "logit_bias", ("batch", "serial"), "lane for requests with a logit_bias"),
)


def quick_values(settings: Settings) -> dict[str, str]:
    """What each quick control shows for these settings."""
    dumped = settings.model_dump(mode="json")
    out = {}
    for key, *_ in QUICK:
        section, name = key.split(".")
        out[key] = str(dumped[section][name])
    return out


def quick_controls(values: dict[str, str] | None) -> list[dict[str, Any]]:
    return [
        {
            "key": key,
            "id": "q-" + key.replace(".", "-"),
            "label": label,
            "hint": hint,
            "kind": kind if isinstance(kind, str) else "choice",
            "choices": kind if isinstance(kind, tuple) else (),
            "value": (values or {}).get(key, ""),
        }
        for key, label, kind, hint in QUICK
    ]


def _typed(kind: Any, raw: str) -> Any:
    """An integer where one is meant; anything else stays text for validation to judge."""
    raw = raw.strip()
    return int(raw) if kind in ("int", "size") and re.fullmatch(r"-?\d+", raw) else raw


def quick_edit(
    text: str, submitted: dict[str, str], shown: dict[str, str]
) -> tuple[str, list[str]]:
    """``text`` with the quick controls that differ from what was shown written in.

    The document is edited in place with tomlkit: only the lines of the changed
    keys change (a key the file does not set yet is added to its section, a
    missing section at the end); comments, order and formatting are kept, an
    inline comment after a changed value included. ``text`` must be a valid config.
    """
    doc = tomlkit.parse(text)
    changed = []
    for key, _, kind, _ in QUICK:
        raw = submitted.get(key)
        if raw is None or raw.strip() == shown.get(key):
            continue
        section, name = key.split(".")
        if section not in doc:
            doc.add(tomlkit.nl())
            doc.add(section, tomlkit.table())
        doc[section][name] = _typed(kind, raw)
        changed.append(key)
    return (tomlkit.dumps(doc) if changed else text), changed
