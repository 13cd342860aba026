"""The KV budget is a promise: the real bytes of mlx-lm's caches, read by the engine
after every admission and every step, never pass it (docs/batching.md, "The
projection"). Real tiny models, the real engine, loads that share prompt-cache
prefixes of every length, with cancels."""

from __future__ import annotations

import asyncio
import random

import pytest

from mlxd.config import load_settings
from mlxd.engine.messages import Failed, SamplingParams
from tests.support.engine import consume, running_engine, settled, token_request

BASES = [[(37 * b + 11 * k) % 450 + 20 for k in range(700)] for b in range(3)]


def mixed_prompt(rnd: random.Random) -> list[int]:
    """A prompt sharing 0-600 tokens with one of three long bases, then its own tail."""
    shared = rnd.choice([0, 0, 3, 40, 255, 256, 300, 600])
    tail = [rnd.randrange(20, 470) for _ in range(rnd.randint(1, 300))]
    return BASES[rnd.randrange(3)][:shared] + tail


@pytest.mark.parametrize(
    ("family", "budget_tokens", "checkpoint_every"),
    [
        ("llama", 1800, 0),
        ("gemma3_text", 1800, 0),
        # Checkpoints every 100 tokens: prefills stop on the way (segments).
        ("qwen3_5", 2400, 100),
    ],
)
def test_real_kv_bytes_never_pass_the_budget_under_a_mixed_load(
    tiny_models, family, budget_tokens, checkpoint_every
):
    per_token = {"llama": 1024, "gemma3_text": 3072, "qwen3_5": 1024}[family]
    budget = budget_tokens * per_token
    settings = {
        "batch": {
            "size": 6,
            "kv_budget": budget,
            "decode_allowance": 64,
            "prompt_concurrency": 6,
            "prefill_step_size": 512,
        },
        "sampling": {"temperature": 0.7},
        "prompt_cache": {"checkpoint_every": checkpoint_every, "disk": False},
    }
    with running_engine(tiny_models(family), **settings) as engine:

        async def client(n: int) -> list:
            rnd = random.Random(n)
            outs, ids = [], mixed_prompt(rnd)
            for i in range(8):
                request = token_request(f"c{n}-{i}", ids, rnd.randint(1, 16))
                cancel = rnd.randint(1, 8) if rnd.random() < 0.1 else None
                out = await consume(engine, request, cancel_after=cancel)
                outs.append(out)
                if out.ok and rnd.random() < 0.5:  # the conversation goes on: an exact prefix
                    ids = ids + out.tokens + [rnd.randrange(20, 470) for _ in range(20)]
                else:
                    ids = mixed_prompt(rnd)
            return outs

        async def main() -> list:
            return [o for outs in await asyncio.gather(*map(client, range(6))) for o in outs]

        outs = asyncio.run(main())
        snap = settled(engine, timeout=120)
    refused = [o.accepted for o in outs if isinstance(o.accepted, Failed)]
    assert not refused, refused[:3]
    assert all(o.ok or o.end is None for o in outs)
    assert snap.prompt_cache.hits > 0  # the load did share prefixes
    assert 0 < snap.batch.max_kv_bytes_seen <= budget
    assert snap.counters["kv_over_budget_steps"] == 0


def test_rows_prefilled_from_prefixes_of_different_lengths_stay_within_the_budget(tiny_models):
    """The soak's overshoot, made deterministic: a conversation with a 300-token cached
    prefix and a fresh 300-token prompt admitted in the same pass share one prompt
    batch at 300 + 299 tokens for a round; admission must count that, not 2 x 556."""
    llama = tiny_models("llama")
    base = BASES[0][:300]
    budget = 2 * 556 * 1024  # what the two rows cost at their own lengths
    with running_engine(llama, batch={"size": 4, "kv_budget": budget}) as engine:

        async def main():
            await consume(engine, token_request("fill", base, 1))  # the cache holds 301 tokens
            # A seeded request runs alone (serial lane) while both others queue, so that
            # both are admitted in one pass when it ends.
            seeded = SamplingParams(temperature=0.0, seed=1)
            serial = asyncio.create_task(
                consume(engine, token_request("serial", [5, 6, 7], 150, sampling=seeded))
            )
            while not any(r.id == "serial" for r in engine.snapshot().rows):
                await asyncio.sleep(0.005)
            hit = asyncio.create_task(consume(engine, token_request("hit", base + [9] * 10, 5)))
            fresh = asyncio.create_task(consume(engine, token_request("fresh", BASES[1][:300], 5)))
            return await asyncio.gather(serial, hit, fresh)

        outs = asyncio.run(main())
        snap = settled(engine)
    assert all(o.ok for o in outs)
    assert outs[1].end.usage.cached_tokens == 300
    assert 0 < snap.batch.max_kv_bytes_seen <= budget
    assert snap.counters["kv_over_budget_steps"] == 0


def test_a_reload_projects_queued_requests_anew_and_refuses_what_can_never_fit(tiny_models):
    llama = tiny_models("llama")
    with running_engine(llama, batch={"size": 4}) as engine:

        async def main():
            seeded = SamplingParams(temperature=0.0, seed=1)
            serial = asyncio.create_task(
                consume(engine, token_request("serial", [5, 6, 7], 150, sampling=seeded))
            )
            while not any(r.id == "serial" for r in engine.snapshot().rows):
                await asyncio.sleep(0.005)
            # Queued behind the serial row: 300 + min(300, allowance) and 700 + 10 tokens.
            fits = asyncio.create_task(consume(engine, token_request("fits", BASES[0][:300], 300)))
            never = asyncio.create_task(consume(engine, token_request("never", BASES[1][:700], 10)))
            while len(engine.snapshot().pending) < 2:
                await asyncio.sleep(0.005)
            # 600 slots: "fits" needs 512 with the new allowance (768 with the old one);
            # "never" needs 768 whatever the allowance.
            batch = {"size": 4, "kv_budget": "600KiB", "decode_allowance": 64}
            settings = load_settings(
                None, overrides={"model": {"path": str(llama)}, "batch": batch}
            )
            await asyncio.wrap_future(engine.apply(settings))
            return await asyncio.wait_for(asyncio.gather(serial, fits, never), 60)

        serial, fits, never = asyncio.run(main())
    assert serial.ok and fits.ok and len(fits.tokens) > 0
    assert isinstance(never.end, Failed)
    assert (never.end.status, never.end.code) == (400, "context_over_budget")
    assert "while this request waited" in never.end.message
