"""The editor's quick controls: the few keys an operator changes most, as form fields."""

from __future__ import annotations

import re
from typing import Any

import tomli_w

from mlxd.config import Settings, parse_toml

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

    Only those keys change in the parsed file; everything else is kept, but
    tomli-w drops comments and formatting. ``text`` must be a valid config.
    """
    data = parse_toml(text, "")
    changed = []
    for key, _, kind, _ in QUICK:
        raw = submitted.get(key)
        if raw is None or raw.strip() == shown.get(key):
            continue
        section, name = key.split(".")
        data.setdefault(section, {})[name] = _typed(kind, raw)
        changed.append(key)
    return (tomli_w.dumps(data) if changed else text), changed
