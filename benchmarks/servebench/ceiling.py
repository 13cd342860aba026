"""The ceiling worker: mlx-lm's ``batch_generate`` in its own process, every token timed."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servebench.cpu import CpuWindow
from servebench.records import WARMUP_TOKENS, Stream, story_prompt


def ceiling_worker(spec_path: str, out_path: str) -> None:
    """Runs in its own process: ``batch_generate`` per C, with each token timestamped.

    ``BatchGenerator.next_generated`` (what ``batch_generate`` loops on) is
    wrapped to stamp every response as it returns to that loop and to read
    ``prompt_cache_nbytes``; ``batch_generate`` itself is called unchanged.
    """
    spec = json.loads(Path(spec_path).read_text())
    import importlib

    import mlx.core as mx
    import mlx_lm

    # mlx_lm re-exports a function named ``generate``: fetch the module itself.
    gen_mod = importlib.import_module("mlx_lm.generate")

    from mlxd.runtime.blas import describe

    model, tokenizer = mlx_lm.load(spec["model"])
    base_cls = gen_mod.BatchGenerator
    events: list[tuple[int, float, str | None, int]] = []
    peak = [0]

    class TimedBatchGenerator(base_cls):  # type: ignore[misc, valid-type]
        def next_generated(self):
            responses = super().next_generated()
            now = time.perf_counter()
            peak[0] = max(peak[0], self.prompt_cache_nbytes)
            events.extend((r.uid, now, r.finish_reason, r.token) for r in responses)
            return responses

    def run(
        prompts: list[list[int]], c: int, max_tokens: int
    ) -> tuple[float, list[dict], Any, int, float | None]:
        events.clear()
        peak[0] = 0
        gen_mod.BatchGenerator = TimedBatchGenerator
        window = CpuWindow("self")
        try:
            t0 = time.perf_counter()
            response = gen_mod.batch_generate(
                model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True,
                completion_batch_size=c, prefill_batch_size=spec["prefill_batch_size"],
                prefill_step_size=spec["prefill_step_size"],
            )  # fmt: skip
        finally:
            gen_mod.BatchGenerator = base_cls
        eos = set(tokenizer.eos_token_ids)
        streams = []
        for i, prompt in enumerate(prompts):
            mine = [e for e in events if e[0] == i]  # a fresh generator numbers uids 0..C-1
            text_times = [t for _, t, reason, tok in mine if not (reason == "stop" and tok in eos)]
            streams.append(
                asdict(
                    Stream(
                        sent=t0,
                        first=mine[0][1],
                        end=mine[-1][1],
                        chunks=text_times,
                        tokens=len(mine),
                        prompt_tokens=len(prompt),
                        finish_reason=mine[-1][2],
                        text=response.texts[i],
                    )
                )
            )
        return t0, streams, response.stats, peak[0], window.background_cores()

    def tokenize(i: int) -> list[int]:
        return list(tokenizer.apply_chat_template(story_prompt(i), add_generation_prompt=True))

    top = max(spec["concurrency"])
    print(f"ceiling: warm-up (B={top}, {WARMUP_TOKENS} tokens)", file=sys.stderr, flush=True)
    run([tokenize(i) for i in range(top)], top, min(WARMUP_TOKENS, spec["max_tokens"]))
    waves: dict[str, dict] = {}
    for c in spec["concurrency"]:
        prompts = [tokenize(i) for i in range(c)]
        t0, streams, stats, kv, background = run(prompts, c, spec["max_tokens"])
        batch_stats = {
            k: getattr(stats, k)
            for k in ("prompt_tokens", "prompt_time", "generation_tokens", "generation_steps",
                      "decode_time", "wall_time", "generation_time", "overhead_time")
        }  # fmt: skip
        waves[str(c)] = {
            "t0": t0,
            "streams": streams,
            "peak_kv_bytes": kv,
            "background_cores": background,
            "batch_stats": batch_stats,
        }
        print(f"ceiling: B={c} done in {stats.wall_time:.1f} s", file=sys.stderr, flush=True)
    runtime = describe() | {"device": str(mx.default_device())}
    Path(out_path).write_text(json.dumps({"waves": waves, "runtime": runtime}))
