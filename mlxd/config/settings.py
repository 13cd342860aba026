"""The whole config as one frozen object, and how each key takes effect."""

from __future__ import annotations

import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Any, cast

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, TomlConfigSettingsSource

from mlxd.config.batches import BatchesSettings
from mlxd.config.entry import ModelEntry
from mlxd.config.keys import KEY_NAME, KeyEntry, SchedulingSettings
from mlxd.config.reasoning import ReasoningSettings
from mlxd.config.sections import (
    BatchSettings,
    ClusterSettings,
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
)
from mlxd.config.speculative import SpeculativeSettings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # pyright: ignore[reportMissingImports] - installed on 3.10 only


_toml_input: ContextVar[tuple[Path, str] | None] = ContextVar("_toml_input", default=None)


class _TomlTextSource(TomlConfigSettingsSource):
    """pydantic-settings' TOML source, fed text that was already read.

    Reading once lets a parse error name the file and line, and lets the
    dashboard editor validate text before it is written.
    """

    def __init__(self, settings_cls: type[BaseSettings], path: Path, text: str):
        self._text = text
        super().__init__(settings_cls, toml_file=path)

    def _read_files(self, files: Any, deep_merge: bool = False) -> dict[str, Any]:
        return tomllib.loads(self._text)


class Settings(BaseSettings):
    """Every mlxd setting, one frozen object. Build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        env_prefix="MLXD_",
        env_nested_delimiter="__",
        nested_model_default_partial_update=True,
    )

    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    batch: BatchSettings = BatchSettings()
    lanes: LaneSettings = LaneSettings()
    prompt_cache: PromptCacheSettings = PromptCacheSettings()
    sampling: SamplingSettings = SamplingSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    limits: LimitSettings = LimitSettings()
    responses: ResponsesSettings = ResponsesSettings()
    batches: BatchesSettings = BatchesSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    memory: MemorySettings = MemorySettings()
    cluster: ClusterSettings | None = None
    scheduling: SchedulingSettings = SchedulingSettings()
    reasoning: ReasoningSettings = ReasoningSettings()
    # [keys.<name>] tables: API keys as identities (mlxd.config.keys).
    keys: dict[str, KeyEntry] = {}
    # [models.<id>] tables; empty when the config has the one [model] table.
    models: dict[str, ModelEntry] = {}

    @field_validator("keys")
    @classmethod
    def _check_keys(cls, value: dict[str, KeyEntry]) -> dict[str, KeyEntry]:
        secrets: dict[str, str] = {}
        for name, entry in value.items():
            if not KEY_NAME.match(name):
                raise ValueError(
                    f"[keys.{name}]: a key's name is 1-64 letters, digits, '_', '.' or '-' "
                    "(it shows in logs, /stats and metrics)"
                )
            if entry.key is not None:
                secret = entry.key.get_secret_value()
                if secret in secrets:
                    raise ValueError(f"[keys.{name}] has the same key as [keys.{secrets[secret]}]")
                secrets[secret] = name
        return value

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        sources = [init_settings, env_settings]
        toml = _toml_input.get()
        if toml is not None:
            sources.append(_TomlTextSource(settings_cls, *toml))
        return tuple(sources)


def _section_class(annotation: Any) -> type[Section]:
    # An optional section ([cluster]) is annotated ``Section | None``.
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, Section):
            return arg
    return annotation


SECTIONS: dict[str, type[Section]] = {
    name: _section_class(field.annotation)
    for name, field in Settings.model_fields.items()
    if name not in ("models", "keys")  # tables of tables: ModelEntry, KeyEntry
}


def reload_class(section: str, key: str) -> Reload:
    """How a change to ``[section] key`` takes effect: live, swap or restart."""
    extra = SECTIONS[section].model_fields[key].json_schema_extra
    assert isinstance(extra, dict)
    return cast(Reload, extra["reload"])  # written by _field() as one of Reload's values
