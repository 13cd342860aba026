"""Settings: the one home of every mlxd setting.

A settings object is built from, highest priority first: explicit overrides
(command-line flags), ``MLXD_*`` environment variables (``MLXD_BATCH__SIZE=4``),
then the TOML file. Every section is frozen and forbids unknown keys, so a typo
is an error that names the file and the key. Building settings is pure and
cheap; nothing here loads a model or touches MLX.

Each field says how a change to it takes effect when the file is reloaded:
``live`` (applied between two engine steps), ``swap`` (the model is drained and
swapped) or ``restart`` (reported as ``restart_required``, not applied).

The package: ``units`` (byte sizes, durations), ``sections`` (one model per
table; ``keys``, ``batches`` and
``speculative`` hold their own), ``registry`` (the models a
config names), ``issues`` (errors with keys and lines); this module builds and
writes the whole.
"""

from __future__ import annotations

from mlxd.config.batches import BatchesSettings
from mlxd.config.entry import ModelEntry
from mlxd.config.issues import ConfigError, ConfigIssue, parse_toml
from mlxd.config.loading import dump_toml, effective_toml, load_settings
from mlxd.config.sections import (
    BatchSettings,
    ClusterSettings,
    LaneChoice,
    LaneSettings,
    LimitSettings,
    MemorySettings,
    ModelSettings,
    PromptCacheSettings,
    Reload,
    ResponsesSettings,
    RuntimeSettings,
    SamplingSettings,
    Section,
    ServerSettings,
    default_state_dir,
)
from mlxd.config.settings import SECTIONS, Settings, reload_class
from mlxd.config.speculative import SpeculativeSettings
from mlxd.config.units import Bytes, KeepAlive, KvBudget, format_bytes, parse_bytes, shown_value

__all__ = [
    "SECTIONS",
    "BatchSettings",
    "BatchesSettings",
    "Bytes",
    "ClusterSettings",
    "ConfigError",
    "ConfigIssue",
    "KeepAlive",
    "KvBudget",
    "LaneChoice",
    "LaneSettings",
    "LimitSettings",
    "MemorySettings",
    "ModelEntry",
    "ModelSettings",
    "PromptCacheSettings",
    "Reload",
    "ResponsesSettings",
    "RuntimeSettings",
    "SamplingSettings",
    "Section",
    "ServerSettings",
    "Settings",
    "SpeculativeSettings",
    "default_state_dir",
    "dump_toml",
    "effective_toml",
    "format_bytes",
    "load_settings",
    "parse_bytes",
    "parse_toml",
    "reload_class",
    "shown_value",
]
