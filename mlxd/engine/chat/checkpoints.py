"""Where a prompt's prefill keeps checkpoints, and the lookup facts a request is told.

A cache that cannot be rewound (recurrent state, a sliding window that has
wrapped, a list of both) can only be reused from a position it was saved
at. So while a prompt is prefilled, both lanes keep a copy of its cache at
the positions later prompts are likely to share (:func:`plan`):

- the end of the system prefix (the system/developer messages and the tool
  schemas, as the chat template renders them; computed at intake) — a new
  conversation with the same instructions starts there;
- every ``[prompt_cache] checkpoint_every`` tokens of a long prompt — a
  prompt that diverges in the middle (an edited history) loses at most that
  many tokens;
- the end of the prompt, before the generation prompt's think opener — the
  next turn of the conversation starts there.

A model whose every layer cache can be cut back (``KVCache``) needs none of
them: the finished row's cache serves every prefix of it.
"""

from __future__ import annotations

import logging
from typing import Any

from mlxd.engine.chat.prompt_cache import Fetched, Kind
from mlxd.engine.chat.vision_intake import decode_text
from mlxd.engine.messages import CacheLookup

logger = logging.getLogger(__name__)

# Characters of decoded prompt shown on each side of a divergence.
SNIPPET_CHARS = 60
# Tokens decoded to find them (a token is rarely under one character).
_SNIPPET_TOKENS = 48
# How far back from a prompt's end a think opener still belongs to the generation prompt.
_THINK_TAIL = 11


def plan(
    prompt_len: int,
    cached: int,
    *,
    system_end: int | None,
    prompt_end: int | None,
    every: int,
) -> list[tuple[int, Kind]]:
    """The positions (token counts) after which the prefill keeps a checkpoint, with their kinds.

    Only positions past ``cached`` (already in the cache the row starts
    from) and before the last token (always prefilled with the first
    sampled token) count; where two fall together, the more valuable kind
    wins (system, then user, then checkpoint).
    """
    points: dict[int, Kind] = {}
    if every > 0:
        for p in range(every, prompt_len, every):
            points[p] = "checkpoint"
    if prompt_end is not None:
        points[prompt_end] = "user"
    if system_end is not None:
        points[system_end] = "system"
    return sorted((p, k) for p, k in points.items() if cached < p <= prompt_len - 1)


def segments(rest: list[int], start: int, positions: list[int]) -> list[list[int]]:
    """``rest`` (the prompt from token ``start`` on) cut at each of ``positions``."""
    out, at = [], start
    for p in positions:
        out.append(rest[at - start : p - start])
        at = p
    out.append(rest[at - start :])
    return out


def prompt_end(tokenizer: Any, ids: list[int]) -> int:
    """Where a prompt's reusable part ends: before a think opener the generation prompt added.

    Chat templates of reasoning models end the generation prompt with a
    think opener that the next turn's history does not repeat (the reasoning
    is stripped), so the checkpoint goes before it, as mlx_lm.server's
    segments do; otherwise right before the last token.
    """
    end = len(ids) - 1
    if getattr(tokenizer, "has_thinking", False):
        try:
            start = tokenizer.rfind_think_start(ids, start=max(0, len(ids) - _THINK_TAIL))
        except Exception:  # a tokenizer wrapper without the helper
            start = -1
        if 0 < start < end:
            end = start
    return end


def system_end(ids: list[int], system_ids: list[int]) -> int | None:
    """Where the system prefix ends: the tokens ``ids`` shares with the rendered system part.

    ``system_ids`` is the template rendered with the leading system messages
    (and the tools) followed by an empty user message, as mlx_lm.server
    does; the first token where the two differ is inside that user turn.
    """
    n = 0
    for a, b in zip(ids, system_ids, strict=False):
        if a != b:
            break
        n += 1
    return n if 0 < n < len(ids) else None


def lookup(fetched: Fetched, prompt: list[int], tokenizer: Any) -> CacheLookup:
    """The facts of one lookup, with the decoded text on each side of the divergence."""
    cached = len(prompt) - len(fetched.rest)
    at = fetched.diverged_at
    before = after = ""
    if at is not None:
        before, after = _snippets(tokenizer, prompt, at)
    return CacheLookup(
        prompt_tokens=len(prompt),
        cached_tokens=cached,
        source=fetched.source if cached or fetched.source == "off" else "none",
        diverged_at=at,
        stored=fetched.stored,
        before=before,
        after=after,
    )


def _snippets(tokenizer: Any, prompt: list[int], at: int) -> tuple[str, str]:
    try:
        before = decode_text(tokenizer, prompt[max(0, at - _SNIPPET_TOKENS) : at])
        after = decode_text(tokenizer, prompt[at : at + _SNIPPET_TOKENS])
    except Exception:  # a tokenizer that cannot decode a cut sequence
        logger.debug("cannot decode the text around a prompt-cache divergence", exc_info=True)
        return "", ""
    return before[-SNIPPET_CHARS:], after[:SNIPPET_CHARS]
