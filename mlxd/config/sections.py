"""The config's sections: one frozen pydantic model per TOML table."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from mlxd.config.units import Bytes, KvBudget

Reload = Literal["live", "swap", "restart"]
# The prompt rules mlxd knows (mlxd.api.prompt_rules): known-volatile prompt content.
VolatileRule = Literal["claude_billing_header"]


def _field(default: Any, reload: Reload, description: str, **kwargs: Any) -> Any:
    return Field(default, description=description, json_schema_extra={"reload": reload}, **kwargs)


class Section(BaseModel):
    """A config section: frozen, and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def default_state_dir(platform: str = sys.platform, env: dict[str, str] | None = None) -> Path:
    """Where mlxd keeps state by default: the platform's per-user state directory."""
    env = dict(os.environ) if env is None else env
    home = Path(env.get("HOME") or Path.home())
    if platform == "darwin":
        return home / "Library" / "Application Support" / "mlxd"
    xdg = env.get("XDG_STATE_HOME")
    # The XDG spec ignores a relative path.
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "mlxd"
    return home / ".local" / "state" / "mlxd"


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
    stream_keepalive: float = _field(
        15.0,
        "live",
        "Seconds a stream may go without an event (a long prefill) before mlxd sends a "
        "keep-alive: an Anthropic ping, a Responses response.in_progress, a chat SSE comment; "
        "0 turns them off.",
        ge=0,
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
    fetch_images: bool = _field(
        False,
        "live",
        "Fetch http(s) image URLs named in requests (off: images come inline as base64). "
        "A server-side request forgery risk: see docs/api.md#images.",
    )
    state_dir: str | None = _field(
        None,
        "restart",
        "Directory for state that outlives the process (the prompt cache's disk tier); "
        "default: $XDG_STATE_HOME/mlxd or ~/.local/state/mlxd on Linux, "
        "~/Library/Application Support/mlxd on macOS.",
    )

    @property
    def state_path(self) -> Path:
        """``state_dir``, or the platform's default when it is unset (never created here)."""
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        return default_state_dir()

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
    vision: bool | None = _field(
        None,
        "swap",
        "Load through mlx-vlm and take images (true), or as text only (false); "
        "default: a config.json with a vision_config is a vision-language model.",
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
    kv_bits: Literal[0, 4, 8] = _field(
        0,
        "restart",
        "Quantize the KV cache of full-attention layers to 8 or 4 bits; 0 keeps the "
        "model's dtype. Read when the model loads.",
    )
    kv_group_size: Literal[32, 64, 128] = _field(
        64,
        "restart",
        "Values per quantization group (one scale and bias each) when kv_bits is set; "
        "must divide the model's head_dim.",
    )


LaneChoice = Literal["batch", "serial"]


class LaneSettings(Section):
    logprobs: LaneChoice = _field("batch", "live", "Lane for requests that ask for logprobs.")
    penalties: LaneChoice = _field(
        "batch", "live", "Lane for repetition, presence or frequency penalties."
    )
    logit_bias: LaneChoice = _field("batch", "live", "Lane for requests with a logit_bias.")
    images: LaneChoice = _field(
        "batch", "live", "Lane for requests with images (a vision-language model's)."
    )
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
        64,
        "live",
        "Entries kept (a conversation leaves a few: its checkpoints and its last turn); "
        "0 disables the prompt cache.",
        ge=0,
    )
    checkpoint_every: int = _field(
        8192,
        "live",
        "Keep a checkpoint every this many prompt tokens while a long prompt is prefilled "
        "(models whose cache cannot be rewound: hybrid, recurrent, sliding-window); 0: only "
        "at the end of the system prefix and of the prompt.",
        ge=0,
    )
    disk: bool = _field(
        True, "live", "Keep prompt-cache entries on disk too, so they outlive restarts and unloads."
    )
    disk_dir: str | None = _field(
        None, "live", "Directory of the disk tier; default: <[server] state_dir>/prompt-cache."
    )
    disk_max_bytes: Bytes = _field(
        "16GiB", "live", "Byte cap of the disk tier's directory (least recently used go first)."
    )
    volatile_rules: list[VolatileRule] = _field(
        ["claude_billing_header"],
        "live",
        "Known per-request prompt content removed so the prompt cache can hit "
        "(docs/agents.md); [] turns every rule off.",
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
    image_bytes: Bytes = _field(
        "10MiB", "live", "Largest image a request may carry (decoded from base64); larger gets 400."
    )
    image_pixels: int = _field(
        16_777_216,
        "live",
        "Most pixels (width x height, read from the header before decoding) one image may have.",
        ge=1,
    )
    max_images: int = _field(16, "live", "Most images one request may carry.", ge=0)
    image_fetch_timeout: float = _field(
        10.0,
        "live",
        "Seconds fetching one remote image may take ([server] fetch_images); then 400.",
        gt=0,
    )
    grammar_timeout: float = _field(
        10.0,
        "live",
        "Seconds a request's JSON schema or tool grammar may take to compile; then 400.",
        gt=0,
    )


class ResponsesSettings(Section):
    max_stored: int = _field(
        256,
        "live",
        "Responses kept in memory for previous_response_id and GET; 0 stores none.",
        ge=0,
    )
    max_bytes: Bytes = _field(
        "128MiB",
        "live",
        "Bytes the stored responses may take together (serialized); oldest evicted first.",
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


class MemorySettings(Section):
    budget: KvBudget = _field(
        "auto",
        "live",
        "Bytes all loaded models may use together (weights, KV caches, prompt caches); "
        '"auto" is device memory minus a headroom of 20% (at least 1 GiB).',
    )


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
