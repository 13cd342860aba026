"""Quantized KV caches in the real engine (docs/batching.md, "Quantized KV"): a long
prompt holds under 40% of the bytes at 8 bits, the same budget runs more rows, the
answers stay answers, and both lanes and the prompt cache take the quantized form."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mlxd.config import ConfigError, load_settings
from mlxd.config.registry import for_model
from mlxd.engine.chat.loading import ModelLoadError
from mlxd.engine.chat.quant_load import with_quantized_kv
from mlxd.engine.messages import Finished, SamplingParams
from tests.support.engine import consume, running_engine, settled, token_request
from tests.support.tinymodels import KV_QUANT_FAMILY

LONG = [(13 * k) % 450 + 20 for k in range(2700)]
ROWS = [[(7 * r + 11 * k) % 450 + 20 for k in range(700)] for r in range(6)]


def _run(model, kv_bits: int):
    budget = 3000 * 1024  # 1,024 B per token unquantized: the long prompt, or 3 rows of 700
    settings = {
        "batch": {
            "size": 6,
            "prompt_concurrency": 6,
            "kv_budget": budget,
            "decode_allowance": 16,
            "kv_bits": kv_bits,
        },
        "prompt_cache": {"disk": False},
    }
    with running_engine(model, **settings) as engine:
        long = asyncio.run(consume(engine, token_request("long", LONG, 8)))
        first = settled(engine, timeout=60)

        async def burst():
            return await asyncio.gather(
                *(consume(engine, token_request(f"r{i}", ids, 8)) for i, ids in enumerate(ROWS))
            )

        rows = asyncio.run(burst())
        last = settled(engine, timeout=60)
    assert long.ok and len(long.tokens) == 8
    assert all(o.ok and len(o.tokens) == 8 for o in rows)
    assert 0 < last.batch.max_kv_bytes_seen <= budget
    assert last.counters["kv_over_budget_steps"] == 0
    return first.batch, last.batch, long.tokens


def test_eight_bit_kv_holds_under_40_percent_and_runs_more_rows(tiny_models):
    model = tiny_models(KV_QUANT_FAMILY)
    full_first, full_last, full_tokens = _run(model, 0)
    q_first, q_last, q_tokens = _run(model, 8)
    assert (full_first.kv_bits, q_first.kv_bits) == (0, 8)
    # values + scales + biases: (64 + 2 x 4) bytes per 64 values against 4 x 64 in float32
    assert (full_first.kv_bytes_per_token, q_first.kv_bytes_per_token) == (1024, 288)
    assert (full_first.kv_unquantized_bytes_per_token, q_first.kv_unquantized_bytes_per_token) == (
        0,
        1024,
    )
    assert q_first.max_kv_bytes_seen <= 0.4 * full_first.max_kv_bytes_seen
    assert q_last.max_active_rows_seen > full_last.max_active_rows_seen
    # The first token comes from the same prefill logits (quantized only after)... nearly:
    assert q_tokens[0] == full_tokens[0]


def test_the_serial_lane_and_the_prompt_cache_hold_quantized_caches(tiny_models):
    kv_bits = 4  # 8 bits: the batch test above
    model = tiny_models(KV_QUANT_FAMILY)
    seeded = SamplingParams(temperature=0.0, seed=3)  # a seed runs on the serial lane
    with running_engine(model, batch={"size": 4, "kv_bits": kv_bits}) as engine:
        prompt = LONG[:600]
        serial = asyncio.run(consume(engine, token_request("s", prompt, 6, sampling=seeded)))
        again = asyncio.run(consume(engine, token_request("b", prompt + serial.tokens, 6)))
        snap = settled(engine)
    assert serial.ok and isinstance(again.end, Finished)
    assert again.end.usage.cached_tokens >= 600  # the serial run's quantized cache served it
    assert snap.batch.kv_bits == kv_bits
    assert 0 < snap.prompt_cache.bytes < 600 * 1024 * 0.2  # 160 of 1,024 B per token


def test_the_disk_tier_keeps_quantized_entries_across_a_restart(tmp_path, tiny_models):
    model = tiny_models(KV_QUANT_FAMILY)
    first = LONG[:300]
    turn2 = [*first, 50, 51, 52]
    keys = {"disk_dir": str(tmp_path / "cache")}
    with running_engine(model, batch={"kv_bits": 4}, prompt_cache=keys) as engine:
        warm = asyncio.run(consume(engine, token_request("a", first, 4)))
    with running_engine(model, batch={"kv_bits": 4}, prompt_cache=keys) as engine:
        out = asyncio.run(consume(engine, token_request("b", turn2, 4)))
        state = settled(engine).prompt_cache
    assert warm.ok and isinstance(out.end, Finished)
    assert out.end.lookup is not None and out.end.lookup.source == "disk"
    assert out.end.usage.cached_tokens >= len(first) - 1
    assert state.disk_hits == 1 and state.disk_corrupt == 0
    # Another kv_bits is another model to the disk tier: no hit, nothing dropped as corrupt.
    with running_engine(model, batch={"kv_bits": 8}, prompt_cache=keys) as engine:
        other = asyncio.run(consume(engine, token_request("c", turn2, 4)))
        state = settled(engine).prompt_cache
    assert isinstance(other.end, Finished) and other.end.usage.cached_tokens == 0
    assert state.disk_hits == 0 and state.disk_corrupt == 0


def test_a_group_that_does_not_divide_the_heads_fails_the_load_naming_the_keys(tiny_loaded):
    model, _ = tiny_loaded("llama")  # 16-wide heads
    with pytest.raises(ModelLoadError, match="kv_bits = 8 with kv_group_size = 64"):
        with_quantized_kv(SimpleNamespace(model=model), 8, 64)  # type: ignore[arg-type]


def test_kv_bits_takes_only_what_mlx_can_quantize():
    with pytest.raises(ConfigError):
        load_settings(None, overrides={"batch": {"kv_bits": 6}})
    with pytest.raises(ConfigError):
        load_settings(None, overrides={"batch": {"kv_group_size": 16}})
    assert load_settings(None, overrides={"batch": {"kv_bits": 4}}).batch.kv_bits == 4
    models = {"a": {"path": "/a", "default": True, "batch": {"kv_bits": 8}}, "b": {"path": "/b"}}
    settings = load_settings(None, overrides={"models": models})
    assert (for_model(settings, "a").batch.kv_bits, for_model(settings, "b").batch.kv_bits) == (
        8,
        0,
    )
