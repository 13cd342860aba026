"""Checking a configured model directory before anything drains for it.

A typo in ``[model] path`` should be an error from ``mlxd check-config``,
the editor's Validate and every reload, not a drain of both lanes followed
by a failed load. These checks read a few files and import nothing heavy
(no MLX): the directory exists, ``config.json`` parses and names a
``model_type``, weights and a tokenizer are there, and a ``chat_template``
file is readable. A model that passes can still fail to load (corrupt
weights, an architecture mlx-lm lacks); that is reported by the load.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from mlxd.config import ModelSettings, Settings
from mlxd.config.registry import registry

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def registry_problems(settings: Settings, *, only: set[str] | None = None) -> list[tuple[str, str]]:
    """:func:`model_problems` of every registry entry (or those in ``only``)."""
    if not settings.models:
        return model_problems(settings.model)
    problems: list[tuple[str, str]] = []
    for model_id, entry in settings.models.items():
        if only is None or model_id in only:
            problems += model_problems(entry, table=f"models.{model_id}")
    return problems


def model_problems(model: ModelSettings, *, table: str = "model") -> list[tuple[str, str]]:
    """What is wrong with ``model``'s files, as ``(key, reason)`` pairs; empty if nothing.

    The built-in demo model (no ``path``) is prepared by mlxd itself and not checked here.
    """
    problems: list[tuple[str, str]] = []
    if model.path:
        problems += [(f"[{table}] path", p) for p in _directory_problems(Path(model.path))]
    if model.repo:  # not pulled yet is no config problem: the model is not ready until it is
        from mlxd.hub import repo_dir

        found = repo_dir(model.repo, model.repo_revision)
        if found is not None:
            problems += [(f"[{table}] repo", p) for p in _directory_problems(found)]
    template = model.chat_template
    if template and "{{" not in template and "{%" not in template:
        file = Path(template).expanduser()
        if not file.is_file():
            problems.append(
                (
                    f"[{table}] chat_template",
                    f"{template!r} is neither a template nor a readable file",
                )
            )
    return problems


def _directory_problems(path: Path) -> list[str]:
    path = path.expanduser()
    if not path.is_dir():
        return [
            f"{str(path)!r} is not a directory (a local mlx-lm model directory; for a hub "
            'model use repo = "org/name" and `mlxd pull org/name`)'
        ]
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{str(path)!r} has no config.json; is it an mlx-lm model directory?"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [f"{str(config_file)!r} cannot be read as JSON: {exc}"]
    problems = []
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        problems.append(f"{str(config_file)!r} does not name a model_type")
    if not any(path.glob("*.safetensors")):
        problems.append(f"{str(path)!r} has no *.safetensors weights")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        problems.append(f"{str(path)!r} has no tokenizer ({', '.join(_TOKENIZER_FILES)})")
    return problems


def embeddings_install_hint() -> str:
    """How to install the ``[embeddings]`` extra into the environment this mlxd runs in."""
    return (
        f"`make embeddings` in the mlxd checkout, or `{sys.executable} -m pip install "
        "'mlxd[embeddings]'` (the Python this mlxd runs on)"
    )


def missing_extras(settings: Settings) -> list[str]:
    """Warnings for optional packages the config's models need and this environment lacks."""
    embedding = [i for i, e in registry(settings).items() if e.kind == "embedding"]
    if not embedding or importlib.util.find_spec("mlx_embeddings") is not None:
        return []
    return [
        f'[models.{embedding[0]}] kind = "embedding" needs the optional mlx-embeddings '
        f"package, which is not installed: the model will fail to load. Install it with "
        f"{embeddings_install_hint()}."
    ]
