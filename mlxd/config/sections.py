"""The config's sections: one frozen pydantic model per TOML table."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from mlxd.config.repo import RepoId, Revision
from mlxd.config.section_base import Reload as Reload
from mlxd.config.section_base import Section as Section
from mlxd.config.section_base import _field as _field
from mlxd.config.server_section import ServerSettings as ServerSettings
from mlxd.config.server_section import default_state_dir as default_state_dir
from mlxd.config.units import Bytes, KvBudget

# The prompt rules mlxd knows (mlxd.api.prompt_rules): known-volatile prompt content.
VolatileRule = Literal["claude_billing_header"]


class ModelSettings(Section):
    path: str | None = _field(
        None, "swap", "Local mlx-lm model directory; unset serves the built-in demo model."
    )
    repo: RepoId | None = _field(
        None,
        "swap",
        'A Hugging Face repo ("org/name") read from the shared Hugging Face cache '
        "(get it with `mlxd pull org/name`); exclusive with path.",
    )
    revision: Revision | None = _field(
        None, "swap", "The repo's branch, tag or commit (with repo); unset: main."
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

    @property
    def repo_revision(self) -> str:
        """``revision``, or the default branch."""
        return self.revision or "main"

    @model_validator(mode="after")
    def _path_or_repo(self) -> ModelSettings:
        if self.path is not None and self.repo is not None:
            raise ValueError("give either path (a local directory) or repo (org/name), not both")
        if self.repo is None and self.revision is not None:
            raise ValueError("revision needs a repo")
        return self


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
    prefill_step_seconds: float = _field(
        0.25,
        "live",
        "Seconds one batch step may spend prefilling: chunks shrink below prefill_step_size "
        "to fit, so decoding rows, cached joiners and cancels wait no longer; 0: tokens only.",
        ge=0,
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
    disk_write_delay: float = _field(
        5.0,
        "live",
        "Seconds a prompt's end (or a finished row that can be cut back) stays in RAM, not "
        "replaced by a longer one, before it is written through to disk (a crash keeps it).",
        ge=0,
    )
    disk_max_entries: int = _field(
        2048,
        "live",
        "Most entries the disk tier keeps per model (its index is in memory); "
        "least recently used go first.",
        ge=1,
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
    image_aspect_ratio: float = _field(
        200.0,
        "live",
        "Most times an image's longer edge may be its shorter (read from the header); then 400.",
        ge=1,
    )
    max_images: int = _field(16, "live", "Most images one request may carry.", ge=0)
    audio_bytes: Bytes = _field(
        "25MiB",
        "live",
        "Largest audio file a speech-to-text upload may carry (/v1/audio/transcriptions); "
        "larger gets 413.",
    )
    audio_seconds: float = _field(
        600.0,
        "live",
        "Longest audio a speech-to-text upload may carry, read from its header before "
        "decoding; longer gets 400.",
        gt=0,
    )
    speech_chars: int = _field(
        4096,
        "live",
        "Most characters one text-to-speech input may carry (/v1/audio/speech; OpenAI's "
        "bound); longer gets 400.",
        ge=1,
    )
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
