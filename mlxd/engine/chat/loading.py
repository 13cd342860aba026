"""Loading a model on the engine thread, and what mlxd needs to know about it.

Everything here runs on the engine thread: it creates MLX state.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx.utils import tree_reduce
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache

from mlxd.config import ModelSettings
from mlxd.engine.chat.kv_caches import flatten
from mlxd.engine.chat.vision_loading import vision_unsupported, wants_vision
from mlxd.engine.messages import ModelInfo
from mlxd.engine.policy.admission import CacheLayout, LayerLayout
from mlxd.engine.policy.lanes import Capabilities
from mlxd.engine.weights import nbytes

if TYPE_CHECKING:
    from mlxd.engine.chat.grammar import Grammars
    from mlxd.engine.chat.vision_intake import Processor

logger = logging.getLogger(__name__)

# How the load log names the layer cache kinds of admission.LayerLayout.
_KIND_WORDS = {"full": "full attention", "window": "sliding window", "state": "recurrent state"}


class ModelLoadError(Exception):
    """The configured model cannot be loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    """A model and tokenizer owned by the engine thread."""

    model: Any
    tokenizer: Any
    info: ModelInfo
    layout: CacheLayout
    capabilities: Capabilities
    weights_bytes: int
    # Prompt-cache entries are keyed by this, so a swapped model never sees
    # another model's cache.
    key: str
    # llguidance's tokenizer and compiled-grammar cache (mlxd.engine.chat.grammar).
    grammars: Grammars | None = None
    # make_prompt_cache's top-level classes, one per layer (a disk entry must match them).
    cache_classes: tuple[str, ...] = ()
    # Every layer's cache can be cut back to any prefix (KVCache): no checkpoints needed.
    rewindable: bool = False
    # A vision-language model's processor (mlxd.engine.chat.vision_intake), else None.
    vision: Processor | None = None
    # [speculative] mode = "draft": the draft model (mlxd.engine.chat.speculative.drafter).
    draft: Any = None
    # (bits, group size) of its quantized KV cache (mlxd.engine.chat.quant_cache); None: off.
    kv_quant: tuple[int, int] | None = None
    # With kv_quant: the KV bytes per token its cache would take unquantized (what it saves).
    kv_plain_bytes_per_token: int = 0


def resolve_model_path(settings: ModelSettings, *, optimized_blas: bool) -> tuple[Path, str]:
    """The directory to load and the model id to serve it under."""
    if settings.repo:
        from mlxd.hub import NotPulled, local_snapshot

        try:
            path = local_snapshot(settings.repo, settings.repo_revision)
        except NotPulled as exc:
            raise ModelLoadError(str(exc)) from None
        return path, settings.name or settings.repo
    if settings.path:
        path = Path(settings.path).expanduser()
        if not path.is_dir():
            raise ModelLoadError(
                f"model path {str(path)!r} is not a directory. Give a local mlx-lm model "
                'directory, or the hub repo instead: repo = "org/name", fetched with '
                "`mlxd pull org/name`."
            )
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{str(path)!r} has no config.json; is it an mlx-lm model directory?"
            )
        return path, settings.name or path.name

    from mlxd import demo

    dtype = demo.resolve_demo_dtype(
        settings.demo_dtype, system=platform.system(), optimized_blas=optimized_blas
    )
    try:
        path = demo.prepare_demo_model(dtype)
    except demo.DemoModelUnavailable as exc:
        raise ModelLoadError(str(exc)) from exc
    return path, settings.name or demo.DEMO_MODEL_ID


# Templates shipped with mlxd, by the name ``[model] chat_template`` may give.
BUILTIN_TEMPLATES = {"hermes-tools": Path(__file__).parents[2] / "demo" / "hermes-tools.jinja"}


def _read_template(value: str) -> str:
    if "{{" in value or "{%" in value:
        return value
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value].read_text(encoding="utf-8")
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelLoadError(f"cannot read chat_template file {value!r}: {exc}") from exc


# Caches that can be cut back to any shorter prefix, whatever they hold.
_REWINDABLE = {"KVCache", "QuantizedKVCache", "QuantKVCache", "ConcatenateKVCache"}


def cache_facts(caches: list[Any]) -> tuple[tuple[str, ...], bool]:
    """A fresh cache's layer classes, and whether every one of them can be rewound."""
    classes = tuple(type(c).__name__ for c in caches)
    return classes, all(type(c).__name__ in _REWINDABLE for c in flatten(caches))


def _capabilities(caches: list[Any]) -> Capabilities:
    missing = sorted({type(c).__name__ for c in flatten(caches) if not hasattr(type(c), "merge")})
    if missing:
        return Capabilities(False, f"caches without batch support: {', '.join(missing)}")
    return Capabilities(True)


def tool_format(tokenizer: Any) -> str | None:
    """The mlx-lm tool parser module the tokenizer loaded (json_tools, mistral, ...)."""
    if not tokenizer.has_tool_calling:
        return None
    name = tokenizer.init_kwargs.get("tool_parser_type")
    if name:
        return str(name)
    module = getattr(tokenizer.tool_parser, "__module__", "") or ""
    return module.rsplit(".", 1)[-1] or "unknown"


def harmony_or(found: str | None, tokenizer: Any, parser: str | None) -> str | None:
    """``harmony`` for gpt-oss's format (named, or a Harmony template with no other
    parser: mlx-lm has none for it; see mlxd.engine.chat.harmony), else ``found``."""
    from mlxd.engine.chat.harmony import looks_harmony

    if parser == "harmony" or (found is None and looks_harmony(tokenizer)):
        return "harmony"
    return found


def _grammars(tokenizer: Any, width: int) -> Grammars | None:
    """llguidance's tokenizer, built once per model (up to ~1 s on big vocabularies)."""
    from mlxd.engine.chat.grammar import Grammars, make_ll_tokenizer

    started = time.perf_counter()
    try:
        grammars = Grammars(make_ll_tokenizer(tokenizer, width), width)
    except Exception:
        logger.exception("llguidance cannot read this tokenizer; structured output is off")
        return None
    logger.info("grammar tokenizer built in %.2fs", time.perf_counter() - started)
    return grammars


def measure_layout(model: Any, caches: list[Any] | None = None) -> tuple[CacheLayout, int]:
    """Measure each layer's cache by running one token through a fresh cache.

    Measuring (rather than reading the config) gets the activation dtype and
    the per-layer kinds exactly as mlx-lm will allocate them. Also returns
    the width of the logits (the vocabulary, padded), which bounds every
    token id a request may carry.
    """
    caches = make_prompt_cache(model) if caches is None else caches
    logits = model(mx.array([[0]]), cache=caches)
    width = int(logits.shape[-1])
    flat = flatten(caches)
    mx.eval([c.state for c in flat])
    layers = []
    for c in flat:
        keys = getattr(c, "keys", None)
        if isinstance(keys, tuple):  # quantized: values, scales and biases
            keys = keys[0]
        if keys is not None and hasattr(keys, "shape"):
            parts = [
                a for kv in (c.keys, c.values) for a in (kv if isinstance(kv, tuple) else [kv])
            ]
            per_token = sum(a.nbytes for a in parts) // keys.shape[2]
            window = getattr(c, "max_size", None)
            if window:
                layers.append(LayerLayout("window", bytes_per_token=per_token, window=int(window)))
            else:
                layers.append(LayerLayout("full", bytes_per_token=per_token))
        else:
            layers.append(LayerLayout("state", state_bytes=int(c.nbytes)))
    return CacheLayout(tuple(layers)), width


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for (at least 1).

    Vocabulary entries are counted in their stored form, which has at least
    as many characters as the text they decode to (byte-level BPE stores one
    character per byte), so a prompt of more than ``context * this``
    characters certainly has more tokens than the context holds.
    """
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary view: no bound
        return 0
    return max((len(piece) for piece in vocab), default=1) or 1


def load_model(
    settings: ModelSettings,
    *,
    optimized_blas: bool,
    generation: int,
    loader: Callable[[str, dict[str, Any]], tuple[Any, Any, dict]] | None = None,
) -> LoadedModel:
    """Load the configured (or demo) model with ``mlx_lm.load`` and probe it.

    ``loader`` replaces ``mlx_lm.load`` (a cluster rank loads its shard with
    ``sharded_load``, see :mod:`mlxd.engine.cluster.join`).

    Raises:
        ModelLoadError: with a message meant for the operator.
    """
    path, model_id = resolve_model_path(settings, optimized_blas=optimized_blas)
    started = time.perf_counter()
    # Given to the tokenizer before mlx-lm picks its tool parser, so an
    # override template (or an explicit parser) turns tool calling on.
    overrides: dict[str, Any] = {}
    template, parser = settings.chat_template, settings.tool_parser
    if not settings.path and not settings.repo and not template:
        # The demo model calls tools out of the box: its own template has none,
        # so every agent can be tried with no download (docs/agents.md).
        template, parser = "hermes-tools", parser or "json_tools"
    if template:
        overrides["chat_template"] = _read_template(template)
    if parser and parser != "harmony":  # mlx-lm has no Harmony parser: mlxd reads it
        overrides["tool_parser_type"] = parser
    vision = None
    wanted = loader is None and wants_vision(settings, path)
    if wanted and settings.vision is None and (why := vision_unsupported(path)):
        # Detected, not asked for: serve it as text, as before vision models existed.
        logger.warning("%s has a vision part, served as text only: %s", path, why)
        wanted = False
    try:
        if wanted:
            model, tokenizer, config, vision = _load_vision(path, overrides)
        elif loader is not None:
            model, tokenizer, config = loader(str(path), overrides)
        else:
            # With return_config, mlx_lm.load returns three values (its annotation allows two).
            model, tokenizer, config = cast(
                "tuple[Any, Any, dict[str, Any]]",
                mlx_load(str(path), tokenizer_config=overrides, return_config=True),
            )
    except ModelLoadError:
        raise
    except Exception as exc:
        name = "sharded_load" if loader is not None else "mlx_lm.load"
        raise ModelLoadError(f"{name}({str(path)!r}) failed: {exc}") from exc

    text_config = config.get("text_config") or {}
    declared = (
        config.get("max_position_embeddings")
        or config.get("max_seq_len")
        or text_config.get("max_position_embeddings")
        or 4096
    )
    context = settings.max_context or int(declared)
    # A vision model's weights include the vision tower's and the projector's.
    weights = nbytes(model.vlm if vision is not None else model)
    layout, logits_width = measure_layout(model)
    fresh = make_prompt_cache(model)
    capabilities = _capabilities(fresh)
    cache_classes, rewindable = cache_facts(fresh)
    grammars = _grammars(tokenizer, logits_width)
    # Every id must index both the tokenizer and the model's embedding/logits.
    vocab = min(len(tokenizer), logits_width)
    info = ModelInfo(
        id=model_id,
        path=str(path),
        family=str(config.get("model_type", "unknown")),
        context_length=context,
        created=int(time.time()),
        batchable=capabilities.batchable,
        cache_kinds=layout.kinds,
        tool_format=harmony_or(tool_format(tokenizer), tokenizer, parser),
        reasoning=bool(tokenizer.has_thinking) or harmony_or(None, tokenizer, parser) is not None,
        structured_output=grammars is not None,
        vocab_size=vocab,
        max_token_chars=max_token_chars(tokenizer),
        dtype=describe_dtype(model, config),
        weights_bytes=weights,
        vision=vision is not None,
    )
    logger.info(
        "loaded %s (%s%s, %s) in %.1fs: context %d, %d MiB of weights, KV cache layers: %s; %s",
        model_id,
        info.family,
        ", vision" if vision is not None else "",
        path,
        time.perf_counter() - started,
        context,
        weights // 2**20,
        ", ".join(_KIND_WORDS.get(k, k) for k in layout.kinds),
        "requests can share a batch"
        if capabilities.batchable
        else f"one request at a time, the serial lane ({capabilities.why_not})",
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        info=info,
        layout=layout,
        capabilities=capabilities,
        weights_bytes=weights,
        key=f"{path}#{generation}",
        grammars=grammars,
        cache_classes=cache_classes,
        rewindable=rewindable,
        vision=vision,
    )


def _load_vision(path: Path, overrides: dict[str, Any]) -> tuple[Any, Any, dict, Processor]:
    from mlxd.engine.chat.vision_loading import VisionLoadError, load_vision

    try:
        return load_vision(path, overrides)
    except VisionLoadError as exc:
        raise ModelLoadError(str(exc)) from exc


def describe_dtype(model: Any, config: dict[str, Any]) -> str:
    """The weights' precision: ``4-bit (group 64)`` when quantized, else the float dtype."""
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("bits"):
        return f"{quant['bits']}-bit (group {quant.get('group_size', '?')})"
    dtypes: dict[str, int] = {}

    def count(acc: int, x: Any) -> int:
        if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating):
            name = str(x.dtype).removeprefix("mlx.core.")
            dtypes[name] = dtypes.get(name, 0) + x.nbytes
        return acc

    tree_reduce(count, model, 0)
    return max(dtypes, key=dtypes.__getitem__) if dtypes else "unknown"


def allocator_bytes() -> dict[str, int]:
    """MLX's allocator right now: active, peak (since start) and cached bytes."""
    return {
        "active_bytes": int(mx.get_active_memory()),
        "peak_bytes": int(mx.get_peak_memory()),
        "cache_bytes": int(mx.get_cache_memory()),
    }


def device_memory_bytes() -> int:
    """Memory the KV budget is carved from (see :func:`admission.auto_budget`)."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_name() -> str:
    device = mx.default_device()
    kind = "gpu" if device.type == mx.DeviceType.gpu else "cpu"
    name = mx.device_info().get("device_name") or platform.machine()
    return f"{kind} ({name})"
