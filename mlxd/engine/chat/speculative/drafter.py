"""Draft-model speculation: a small model with the target's tokenizer drafts each row's tokens.

The draft model is loaded with its target (:func:`attach_draft`, from the
model load), and its weights count in the target's ``weights_bytes``, so the
memory budget holds both. Each batch row gets its own draft cache (mlx-lm's
``KVCache`` per layer), which follows the row lazily: before drafting, the
cache is cut back to the longest prefix it shares with the row's tokens and
fed what it misses, then the model drafts greedily, one token at a time.

Rows draft one after another (their caches have different lengths): a
draft model costs ``rows x depth`` small forwards per step. Its caches count
in the batch's KV bytes (:attr:`Drafter.nbytes`; see
docs/batching.md#speculative-decoding).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlxd.config import SpeculativeSettings
from mlxd.engine.chat.loading import LoadedModel, ModelLoadError
from mlxd.engine.chat.speculative.assistant_model import is_assistant, load_assistant
from mlxd.engine.weights import nbytes

logger = logging.getLogger(__name__)

_CHUNK = 512

# Probe text whose encoding the draft's tokenizer must share with the target's.
_PROBE = 'Hello, world! 123 {"key": [1, 2]}\n\tdef f(x): return x ** 2  # ünïcödé'


@dataclass
class DraftModel:
    """A loaded draft model: the module, its directory and its weights' bytes."""

    model: Any
    path: str
    weights_bytes: int


def wanted_draft(settings: SpeculativeSettings) -> str | None:
    """The draft directory ``settings`` ask for (None unless ``mode = "draft"``)."""
    return settings.draft_model if settings.mode == "draft" else None


def attach_draft(loaded: LoadedModel, settings: SpeculativeSettings) -> LoadedModel:
    """``loaded`` with the draft model ``settings`` ask for, its bytes counted in the weights."""
    path = wanted_draft(settings)
    if path is None:
        return loaded
    if is_assistant(path):  # a Gemma 4 assistant drafts from the target's state (.assistant)
        draft = load_assistant(path, loaded)
    else:
        draft = load_draft(path, loaded.tokenizer)
    weights = loaded.weights_bytes + draft.weights_bytes
    info = replace(loaded.info, weights_bytes=loaded.info.weights_bytes + draft.weights_bytes)
    logger.info("loaded the draft model %s: %d MiB", path, draft.weights_bytes // 2**20)
    return replace(loaded, draft=draft, weights_bytes=weights, info=info)


def load_draft(path: str, tokenizer: Any) -> DraftModel:
    """Load ``path`` as a draft for a target with ``tokenizer``; raises ``ModelLoadError``."""
    from mlx_lm import load as mlx_load

    where = Path(path).expanduser()
    if not where.is_dir():
        raise ModelLoadError(
            f"[speculative] draft_model {path!r} is not a directory (a local mlx-lm model)"
        )
    try:
        model, draft_tokenizer = mlx_load(str(where))[:2]
    except Exception as exc:
        raise ModelLoadError(f"[speculative] draft_model {path!r} failed to load: {exc}") from exc
    if draft_tokenizer.encode(_PROBE) != tokenizer.encode(_PROBE) or len(draft_tokenizer) != len(
        tokenizer
    ):
        raise ModelLoadError(
            f"[speculative] draft_model {path!r} has another tokenizer than its target"
        )
    if not can_trim_prompt_cache(make_prompt_cache(model)):
        raise ModelLoadError(
            f"[speculative] draft_model {path!r} has caches that cannot be cut back "
            "(sliding-window or recurrent layers); a draft model needs full attention"
        )
    return DraftModel(model, str(where), nbytes(model))


class Drafter:
    """Per-row draft caches of one draft model, keyed by the batch's row uid."""

    def __init__(self, draft: DraftModel):
        self.draft = draft
        self._caches: dict[int, list[Any]] = {}
        # The tokens each row's draft cache holds.
        self._fed: dict[int, list[int]] = {}
        # Where each row's tokens ended when it last drafted: they only grow after that.
        self._base: dict[int, int] = {}

    def propose(self, uid: int, tokens: list[int], pending: int, k: int) -> list[int]:
        """``k`` greedy tokens after ``tokens + [pending]``."""
        model = self.draft.model
        cache = self._caches.get(uid)
        fed = self._fed.get(uid, [])
        if cache is None:
            cache, fed = make_prompt_cache(model), []
        history = [*tokens, pending]
        base = min(self._base.get(uid, 0), len(fed))
        keep = base + _shared(fed[base:], history[base:])
        if keep < len(fed):
            trim_prompt_cache(cache, len(fed) - keep)
        if keep == len(history):  # never expected: the pending token is new
            trim_prompt_cache(cache, 1)
            keep -= 1
        rest = history[keep:]
        while len(rest) > _CHUNK:  # a new row's prompt, in prefill-sized chunks
            model(mx.array([rest[:_CHUNK]]), cache=cache)
            mx.eval([c.state for c in cache])
            rest = rest[_CHUNK:]
        logits = model(mx.array([rest]), cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        out = [y]
        for _ in range(k - 1):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            out.append(y)
        mx.eval(out)
        draft = cast("list[int]", mx.concatenate(out).tolist())
        self._caches[uid] = cache
        self._fed[uid] = history + draft[:-1]
        self._base[uid] = len(tokens)
        return draft

    @property
    def nbytes(self) -> int:
        """Bytes every row's draft cache holds."""
        return sum(c.nbytes for cache in self._caches.values() for c in cache)

    def forget(self, live: set[int]) -> None:
        """Drop the caches of rows no longer in the batch."""
        for uid in [u for u in self._caches if u not in live]:
            del self._caches[uid]
            self._fed.pop(uid, None)
            self._base.pop(uid, None)


def _shared(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
