"""Settings: the one home of every mlxd setting.

A settings object is built from, highest priority first: explicit overrides
(command-line flags), ``MLXD_*`` environment variables (``MLXD_BATCH__SIZE=4``),
then the TOML file. Every section is frozen and forbids unknown keys, so a typo
is an error that names the file and the key. Building settings is pure and
cheap; nothing here loads a model or touches MLX.

Each field says how a change to it takes effect when the file is reloaded:
``live`` (applied between two engine steps), ``swap`` (the model is drained and
swapped) or ``restart`` (reported as ``restart_required``, not applied).
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    field_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, TomlConfigSettingsSource

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

Reload = Literal["live", "swap", "restart"]

# ---------------------------------------------------------------- byte sizes

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """Parse a byte count: an integer, or a human string such as ``"6GiB"``.

    Decimal units (``KB``, ``MB``, ``GB``, ``TB``) are powers of 1000, binary
    units (``KiB``, ``MiB``, ``GiB``, ``TiB``) powers of 1024.

    Raises:
        ValueError: for negative numbers, unknown units or anything else.
    """
    if isinstance(value, bool):
        raise ValueError("expected a byte size such as 6GiB, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative (got {value})")
        return value
    if isinstance(value, float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a byte size must be a finite, non-negative number (got {value})")
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not a byte size (examples: 512MiB, 6GiB, 2GB)")
        number, unit = match.groups()
        factor = _UNITS.get(unit.lower())
        if factor is None:
            raise ValueError(
                f"unknown unit {unit!r} in {value!r} (use B, KB, MB, GB, KiB, MiB, GiB)"
            )
        return int(float(number) * factor)
    raise ValueError(f"expected a byte size such as 6GiB, got {type(value).__name__}")


def format_bytes(n: int | float) -> str:
    """Render a byte count for people: ``1.5 GiB``, ``512 MiB``, ``320 B``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _exact_size(n: int) -> str | int:
    """The shortest exact spelling of a byte count, for writing TOML."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return n


Bytes = Annotated[
    int,
    BeforeValidator(parse_bytes),
    PlainSerializer(_exact_size, when_used="json"),
]


def _parse_budget(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = parse_bytes(value)
    if n <= 0:
        raise ValueError('the KV budget must be positive, or "auto"')
    return n


KvBudget = Annotated[
    Literal["auto"] | int,
    BeforeValidator(_parse_budget),
    PlainSerializer(lambda v: v if v == "auto" else _exact_size(v), when_used="json"),
]


def _field(default: Any, reload: Reload, description: str, **kwargs: Any) -> Any:
    return Field(default, description=description, json_schema_extra={"reload": reload}, **kwargs)


class Section(BaseModel):
    """A config section: frozen, and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# ---------------------------------------------------------------- sections

_HOST_NAME = re.compile(r"^(\*|(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?)$")


def _check_allowed_hosts(value: list[str]) -> list[str]:
    out = []
    for raw in value:
        host = raw.strip().lower().rstrip(".")
        if not _HOST_NAME.match(host):
            raise ValueError(
                f"{raw!r} is not a host name: list bare names such as 'box.lan' or "
                "'*.example.com' (no scheme, port or path)"
            )
        out.append(host)
    return out


class ServerSettings(Section):
    host: str = _field(
        "127.0.0.1",
        "restart",
        "Address to bind; off loopback the admin token guards the dashboard.",
    )
    port: int = _field(8080, "restart", "TCP port.", ge=1, le=65535)
    api_keys: list[SecretStr] = _field(
        [], "live", "Bearer keys accepted on /v1 routes; empty means /v1 is open."
    )
    admin_token: SecretStr | None = _field(
        None, "live", "Token for the dashboard, /stats and /admin when bound off loopback."
    )
    allow_anonymous_read: bool = _field(
        False, "live", "Off loopback, let anyone read the dashboard, /stats and /metrics."
    )
    allowed_hosts: list[str] = _field(
        [],
        "live",
        "Extra Host names accepted besides loopback, IP literals, this machine's name and "
        '`host` ("box.lan", "*.example.com"; "*" turns the check off).',
    )
    shutdown_timeout: float = _field(
        30.0, "live", "Seconds in-flight requests may take to finish after SIGTERM.", ge=0
    )
    log_level: Literal["debug", "info", "warning", "error"] = _field(
        "info", "live", "Log level of the daemon (the --log-level flag wins)."
    )
    log_requests: bool = _field(
        True, "live", "One info log line per /v1 request: route, status, lane, tokens, timings."
    )
    unknown_parameters: Literal["reject", "ignore"] = _field(
        "reject",
        "live",
        "Unknown top-level request parameters: 400 (reject), or dropped and listed in the "
        "X-Mlxd-Ignored-Parameters header (ignore).",
    )
    reasoning_field: Literal["reasoning_content", "reasoning", "both"] = _field(
        "reasoning_content",
        "live",
        "Chat field that carries a reasoning model's thinking (message and delta).",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _check_hosts(cls, value: list[str]) -> list[str]:
        return _check_allowed_hosts(value)


class ModelSettings(Section):
    path: str | None = _field(
        None, "swap", "Local mlx-lm model directory; unset serves the built-in demo model."
    )
    name: str | None = _field(
        None, "swap", "Model id clients send and /v1/models lists; default: the directory name."
    )
    chat_template: str | None = _field(
        None, "swap", "Chat template override: a path to a Jinja file, or the template itself."
    )
    tool_parser: str | None = _field(
        None,
        "swap",
        "mlx-lm tool parser (json_tools, mistral, pythonic, ...) when the model does not name one.",
    )
    max_context: int | None = _field(
        None, "swap", "Context length in tokens; default: what the model's config declares.", gt=0
    )
    demo_dtype: Literal["auto", "q4", "bfloat16", "float32"] = _field(
        "auto", "swap", "Weights of the demo model: auto picks per platform and BLAS."
    )
    aliases: list[str] = _field(
        [],
        "live",
        "Other model ids clients may ask for (fnmatch patterns such as 'claude-*'); "
        "they get the served model.",
    )


class BatchSettings(Section):
    size: int = _field(
        8,
        "live",
        "1 runs everything serially; N > 1 batches up to N rows (a mode, not a fallback).",
        ge=1,
        le=256,
    )
    # 8 = the default width: a burst that fills the batch is prefilled as one group
    # (docs/performance.md, "Choosing prompt_concurrency").
    prompt_concurrency: int = _field(
        8, "live", "Prompts prefilled together between two decode steps.", ge=1, le=256
    )
    prefill_step_size: int = _field(
        512, "live", "Prompt tokens per prefill chunk (a decode step runs between chunks).", ge=16
    )
    kv_budget: KvBudget = _field(
        "auto",
        "live",
        'Bytes the batch KV cache may use, or "auto" (device memory minus weights and headroom).',
    )
    decode_allowance: int = _field(
        2048,
        "live",
        "Generated tokens counted per row when projecting KV bytes at admission.",
        ge=1,
    )


LaneChoice = Literal["batch", "serial"]


class LaneSettings(Section):
    logprobs: LaneChoice = _field("batch", "live", "Lane for requests that ask for logprobs.")
    penalties: LaneChoice = _field(
        "batch", "live", "Lane for repetition, presence or frequency penalties."
    )
    logit_bias: LaneChoice = _field("batch", "live", "Lane for requests with a logit_bias.")
    constrained: LaneChoice = _field(
        "batch", "live", "Lane for JSON-schema or forced-tool-call (grammar) requests."
    )


class PromptCacheSettings(Section):
    max_bytes: Bytes = _field(
        "1GiB",
        "live",
        "Byte cap of the prompt (prefix) cache; shrinks by the live batch's KV bytes.",
    )
    max_entries: int = _field(
        10, "live", "Cached conversations kept; 0 disables the prompt cache.", ge=0
    )


class SamplingSettings(Section):
    temperature: float = _field(
        0.0, "live", "Default temperature; 0 is greedy, as in mlx_lm.server.", ge=0, le=2
    )
    top_p: float = _field(1.0, "live", "Default nucleus sampling mass (1 disables).", gt=0, le=1)
    top_k: int = _field(0, "live", "Default top-k (0 disables).", ge=0)
    min_p: float = _field(0.0, "live", "Default min-p (0 disables).", ge=0, le=1)
    max_tokens: int = _field(
        512, "live", "Tokens generated when a request sets no max_tokens.", ge=1
    )


class LimitSettings(Section):
    max_queued: int = _field(
        64, "live", "Requests that may wait for admission; beyond it, 429 with Retry-After.", ge=1
    )
    max_body_bytes: Bytes = _field("4MiB", "live", "Largest request body; larger gets 413.")
    max_tokens: int = _field(8192, "live", "Largest max_tokens a request may ask for.", ge=1)
    header_timeout: float = _field(
        15.0,
        "live",
        "Seconds a client may take to send a request's headers; then the connection closes.",
        gt=0,
    )
    body_timeout: float = _field(
        60.0, "live", "Seconds a client may take to send a request body; then 408.", gt=0
    )


class ResponsesSettings(Section):
    max_stored: int = _field(
        256,
        "live",
        "Responses kept in memory for previous_response_id and GET; 0 stores none.",
        ge=0,
    )
    ttl: float = _field(3600.0, "live", "Seconds a stored response stays retrievable.", gt=0)


class RuntimeSettings(Section):
    blas: str = _field(
        "auto", "restart", 'Linux CPU BLAS: "auto", "off", or the path of a CBLAS shared library.'
    )
    threads: int | None = _field(
        None,
        "restart",
        "BLAS threads; default: the CPUs mlxd may run on (OPENBLAS_NUM_THREADS wins).",
        ge=1,
    )

    @field_validator("blas")
    @classmethod
    def _check_blas(cls, value: str) -> str:
        if value in ("auto", "off") or value.endswith((".so", ".dylib")) or ".so." in value:
            return value
        raise ValueError('use "auto", "off" or the path of a shared library (…/libopenblas.so.0)')


class ClusterSettings(Section):
    """One model sharded across several machines with ``mx.distributed`` (docs/cluster.md)."""

    backend: Literal["ring", "jaccl", "auto"] = _field(
        "auto", "restart", 'MLX distributed backend; "auto" lets MLX pick what is available.'
    )
    hostfile: str | None = _field(
        None,
        "restart",
        "MLX hostfile (JSON list of each rank's addresses); default: $MLX_HOSTFILE.",
    )
    rank: int | None = _field(
        None, "restart", "This process's rank (0 serves HTTP); default: $MLX_RANK.", ge=0
    )
    sharding: Literal["tensor", "pipeline", "auto"] = _field(
        "auto", "restart", 'How the model is split; "auto" is tensor when the model supports it.'
    )
    join_timeout: float = _field(
        60.0, "restart", "Seconds every rank has to join at startup; then the process exits.", gt=0
    )
    step_timeout: float = _field(
        120.0,
        "restart",
        "Seconds one step (or one idle heartbeat) may take before rank 0 gives the peer up.",
        gt=0,
    )


# ---------------------------------------------------------------- settings

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
    limits: LimitSettings = LimitSettings()
    responses: ResponsesSettings = ResponsesSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    cluster: ClusterSettings | None = None

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
    for name, field in Settings.model_fields.items()  # type: ignore[misc]
}


def reload_class(section: str, key: str) -> Reload:
    """How a change to ``[section] key`` takes effect: live, swap or restart."""
    extra = SECTIONS[section].model_fields[key].json_schema_extra
    assert isinstance(extra, dict)
    return extra["reload"]  # type: ignore[return-value]


# ---------------------------------------------------------------- loading


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
        if len(loc) >= 2:
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
            secret = loc[:2] in (["server", "api_keys"], ["server", "admin_token"])
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
    if not parent:
        return list(SECTIONS)
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
        return Settings(**(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(source, _issues_from_validation(exc, text)) from None
    finally:
        if token is not None:
            _toml_input.reset(token)


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
    clean = {
        section: {k: v for k, v in values.items() if v is not None}
        for section, values in data.items()
        if values is not None  # an optional section that is absent ([cluster])
    }
    return tomli_w.dumps(clean)
