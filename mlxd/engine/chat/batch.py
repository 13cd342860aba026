"""The batched lane: mlx-lm's ``BatchGenerator``, driven by mlxd's admission.

mlxd decides who joins (``insert``) and who leaves early (``remove``);
``BatchGenerator`` does the rest: chunked, interleaved prefill of up to
``prompt_concurrency`` prompts, pipelined decode, ``extend`` joins and
``filter`` evictions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlxd.config import BatchSettings, SpeculativeSettings
from mlxd.engine.chat.checkpoints import segments
from mlxd.engine.chat.kv_caches import normalize
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.prefill_pace import PrefillPace
from mlxd.engine.chat.quant_cache import fresh_cache
from mlxd.engine.chat.row import Row
from mlxd.engine.chat.sampling import (
    build_processors,
    build_sampler,
    guard_processor,
    guard_sampler,
)
from mlxd.engine.chat.speculative.speculator import Speculator
from mlxd.engine.chat.vision import guard_tokens, hold, let_go

logger = logging.getLogger(__name__)


@dataclass
class TokenOut:
    row: Row
    token: int
    logprobs: mx.array
    finish_reason: str | None
    cache: list[Any] | None
    all_tokens: list[int] | None


@dataclass
class Checkpoint:
    """A row's cache at one of its prompt's boundaries, taken during prefill."""

    row: Row
    tokens: list[int]
    cache: list[Any]
    kind: Any


class BatchLane:
    """The rows mlxd admitted to the batch, and the generator that steps them."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: BatchSettings,
        *,
        faults: bool = False,
        paced: bool = True,
    ):
        self._loaded = loaded
        self._faults = faults
        # Chunks sized by time (not in a cluster: every rank must cut the prompt alike).
        self._paced = paced
        self._pace = PrefillPace(settings.prefill_step_size, self._seconds(settings))
        self._gen = self._make_generator(settings)
        self.rows: dict[int, Row] = {}
        # The checkpoints the last step took (the engine stores them).
        self.checkpoints: list[Checkpoint] = []
        # One row that joined an empty batch and has been alone since: projected exactly.
        self.lone = False
        # Speculative decoding ([speculative]); None until speculate() is called.
        self.speculator: Speculator | None = None

    def _make_generator(self, settings: BatchSettings) -> BatchGenerator:
        eos = sorted(self._loaded.tokenizer.eos_token_ids)
        gen = BatchGenerator(
            self._loaded.model,
            stop_tokens=[[t] for t in eos],
            completion_batch_size=settings.size,
            prefill_batch_size=settings.prompt_concurrency,
            prefill_step_size=self._pace.chunk(),
        )
        # Each prefill chunk grows the prompt batch from its position, not from spare
        # capacity left behind by rows that moved on (see mlxd.engine.chat.kv_caches).
        prompts = gen._prompt_batch
        chunk = prompts.prompt

        def prompt(tokens: list[list[int]]) -> None:
            normalize(prompts.prompt_cache)
            chunk(tokens)

        prompts.prompt = prompt
        return gen

    def configure(self, settings: BatchSettings) -> None:
        """Apply new widths live; running rows are untouched."""
        gen = self._gen
        gen.prefill_batch_size = settings.prompt_concurrency
        gen.completion_batch_size = max(settings.size, settings.prompt_concurrency)
        self._pace.most, self._pace.seconds = settings.prefill_step_size, self._seconds(settings)
        self._set_chunk()

    def _seconds(self, settings: BatchSettings) -> float:
        return settings.prefill_step_seconds if self._paced else 0.0

    def _set_chunk(self) -> None:
        """The next step's prefill chunk (:class:`~mlxd.engine.chat.prefill_pace.PrefillPace`)."""
        chunk = self._pace.chunk()
        self._gen.prefill_step_size = chunk
        self._gen._prompt_batch.prefill_step_size = chunk

    def speculate(self, settings: SpeculativeSettings) -> None:
        """Apply ``[speculative]`` live (mode "off" steps exactly as without it)."""
        if self.speculator is None:
            self.speculator = Speculator(settings, self._loaded.draft)
            self.speculator.rows = self.rows
            self.speculator.eos = frozenset(self._loaded.tokenizer.eos_token_ids)
            self.speculator.install(self._gen)
        else:
            self.speculator.configure(settings)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Real bytes held by every admitted row's cache, its draft or MTP cache included."""
        spec = self.speculator.cache_bytes() if self.speculator is not None else 0
        return self._gen.prompt_cache_nbytes + spec

    def insert(self, row: Row, cache: list[Any] | None, rest: list[int]) -> None:
        """Hand an admitted row to the generator, starting from ``cache`` if any.

        The prompt is cut at ``row.checkpoints`` (positions past the cached
        prefix): the generator stops at each cut, where :meth:`step` takes a
        copy of the row's cache.
        """
        sampler = build_sampler(row.request, self._loaded.info.vocab_size)
        processors = build_processors(row.request, faults=self._faults, constraint=row.matcher)
        if row.images is not None:
            processors = [guard_tokens(p, row.images.placeholder) for p in processors]
        start = len(row.prompt) - len(rest)
        if cache is None and self._loaded.kv_quant is not None:
            cache = fresh_cache(self._loaded.model, self._loaded.kv_quant)
        # The vision tower runs here, between two steps, for images still to prefill.
        hold(self._loaded.model, row, rest)
        try:
            (uid,) = self._gen.insert_segments(
                [segments(rest, start, [p for p, _ in row.checkpoints])],
                max_tokens=[row.tokens_left],
                caches=[cache] if cache is not None else None,
                all_tokens=[row.prompt[:start]] if cache is not None else None,
                samplers=[guard_sampler(row, sampler)] if sampler else None,
                logits_processors=[[guard_processor(row, p) for p in processors]],
            )
        except BaseException:
            let_go(self._loaded.model, row)
            raise
        self.lone = not self.rows
        row.uid = uid
        self.rows[uid] = row

    def stats(self):
        """``BatchGenerator.stats()``: prefill and decode seconds of the steps in the block."""
        return self._gen.stats()

    def step(self) -> list[TokenOut]:
        """One generator step: a decode step for running rows, a prefill chunk for joiners."""
        with self._gen.stats() as stats:
            prompt_responses, gen_responses = self._gen.next()
        if self.speculator is not None:
            for uid, (drafted, accepted) in self.speculator.tally.rows.items():
                row = self.rows.get(uid)
                if row is not None:
                    row.spec_drafted += drafted
                    row.spec_accepted += accepted
            self.speculator.tally.rows.clear()
        marks = []
        width = 0
        for r in prompt_responses:
            row = self.rows.get(r.uid)
            if row is not None and row.first_token_mono is None:
                width = max(width, r.progress[0] - row.prefill_done)
                row.phase = "prefill"
                row.prefill_done = r.progress[0]
                reached = len(row.prompt) - row.prefill_total + r.progress[0]
                if r.end_of_segment and row.checkpoints and row.checkpoints[0][0] == reached:
                    marks.append(r.uid)
        self.checkpoints = self._checkpoints(marks) if marks else []
        if width:
            self._pace.observe(width, stats.prompt_time)
            self._set_chunk()
        out = []
        for r in gen_responses:
            row = self.rows.get(r.uid)
            if row is None:
                continue
            let_go(self._loaded.model, row)
            if r.finish_reason is not None:
                del self.rows[r.uid]
            out.append(
                TokenOut(row, r.token, r.logprobs, r.finish_reason, r.prompt_cache, r.all_tokens)
            )
        if self.speculator is not None:  # finished rows' draft caches leave with them
            self.speculator.forget(list(self.rows))
        return out

    def _checkpoints(self, uids: list[int]) -> list[Checkpoint]:
        out = []
        for uid, (cache, tokens) in self._gen.extract_cache(uids).items():
            row = self.rows[uid]
            position, kind = row.checkpoints.pop(0)
            if len(tokens) != position:  # never expected: the generator's cut moved
                logger.warning(
                    "a checkpoint of %s held %d tokens, not %d", row.id, len(tokens), position
                )
                continue
            out.append(Checkpoint(row, list(tokens), cache, kind))
        return out

    def remove(self, rows: list[Row], *, return_caches: bool = False) -> dict[int, Any]:
        """Take rows out before they finish (stop string, cancel, failure)."""
        uids = [r.uid for r in rows if r.uid in self.rows]
        for uid in uids:
            let_go(self._loaded.model, self.rows.pop(uid))
        if self.speculator is not None:
            self.speculator.forget(list(self.rows))
        if not uids:
            return {}
        return self._gen.remove(uids, return_prompt_caches=return_caches)

    def reset(self, settings: BatchSettings) -> list[Row]:
        """Drop every row and start a fresh generator (after a failed step)."""
        rows = list(self.rows.values())
        self.rows.clear()
        for row in rows:
            let_go(self._loaded.model, row)
        try:
            self._gen.close()
        except Exception:  # the old generator is beyond use either way
            logger.exception("closing the failed batch generator")
        self._gen = self._make_generator(settings)
        if self.speculator is not None:
            self.speculator.install(self._gen)
        return rows

    def close(self) -> None:
        self._gen.close()
