"""The prompt cache's disk tier on real tiny models: it outlives the engine, and never breaks it.

Entries written by one engine are read by the next one pointed at the same
directory (a restart) and give what a cold prefill gives; a truncated,
garbled, foreign or vanished file is a warning and a miss, never a failed
request; the directory stays under ``disk_max_bytes``, also when the cap is
lowered live; a disk that fills up turns the tier off, and requests go on;
two engines sharing a directory leave only whole, readable files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import struct
import time
from collections import namedtuple
from pathlib import Path

import pytest

from mlxd.config import load_settings
from mlxd.engine.chat.disk_checksum import CorruptEntry, verify_payload
from mlxd.engine.chat.disk_writer import read_metadata
from mlxd.engine.messages import Finished
from tests.support.engine import (
    consume,
    greedy_reference,
    run_all,
    running_engine,
    settled,
    token_request,
    wait_for,
)

MAX_TOKENS = 8


def prompt(tokenizer, n: int, salt: str = "") -> list[int]:
    ids = tokenizer.encode((salt + "The river runs past the old mill every morning. ") * 40)
    return ids[:n]


def cold(model, tokenizer, ids: list[int]) -> list[int]:
    return greedy_reference(model, tokenizer, ids, MAX_TOKENS)


def files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.safetensors") if not p.name.startswith("."))


def disk_bytes(directory: Path) -> int:
    """Bytes of the entries now in ``directory`` (the writer thread may evict one meanwhile)."""
    total = 0
    for p in files(directory):
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


def disk(tmp_path: Path, **keys) -> dict:
    return {"disk_dir": str(tmp_path / "cache"), "checkpoint_every": 64, **keys}


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_entries_outlive_the_engine_and_give_what_a_cold_prefill_gives(
    family, tmp_path, tiny_models, tiny_loaded
):
    model, tokenizer = tiny_loaded(family)
    first = prompt(tokenizer, 260)
    turn2 = [*first, 50, 51, 52, 53]
    with running_engine(tiny_models(family), prompt_cache=disk(tmp_path)) as engine:
        (warm,) = run_all(engine, [token_request("a", first, MAX_TOKENS)])
    written = files(tmp_path / "cache")
    assert warm.ok and written  # written when the engine stopped at the latest
    # They hold prompts: this user's only.
    assert all(p.stat().st_mode & 0o077 == 0 for p in (*written, written[0].parent))
    with running_engine(tiny_models(family), prompt_cache=disk(tmp_path)) as engine:
        (out,) = run_all(engine, [token_request("b", turn2, MAX_TOKENS)])
        state = settled(engine).prompt_cache
    assert isinstance(out.end, Finished)
    assert out.end.lookup is not None and out.end.lookup.source == "disk"
    assert out.end.usage.cached_tokens >= len(first) - 1
    assert out.tokens == cold(model, tokenizer, turn2)
    assert state.disk_hits == 1 and state.disk_tokens == out.end.usage.cached_tokens
    assert state.disk_state == "on" and state.disk_corrupt == 0


def test_bad_files_are_dropped_with_a_warning_and_the_request_is_served(
    tmp_path, tiny_models, tiny_loaded, caplog
):
    model, tokenizer = tiny_loaded("qwen3_5")
    prompts = [prompt(tokenizer, 200, salt=f"{i} ") for i in range(6)]
    with running_engine(tiny_models("qwen3_5"), prompt_cache=disk(tmp_path)) as engine:
        assert all(
            o.ok
            for o in run_all(engine, [token_request(f"w{i}", p, 4) for i, p in enumerate(prompts)])
        )
    written = files(tmp_path / "cache")
    model_dir = written[0].parent
    assert len(written) == 6  # each prompt's end checkpoint
    # Truncated, garbled, and a whole file of another format version.
    truncated, garbled, foreign = written[:3]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    garbled.write_bytes(b"\xff" * 64)
    header = (
        b'{"__metadata__": {"0.mlxd_format": "0"},'
        b' "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    )
    foreign.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    survivors = set(written[3:])
    caplog.set_level(logging.WARNING, logger="mlxd.engine.chat.prompt_disk")
    with running_engine(tiny_models("qwen3_5"), prompt_cache=disk(tmp_path)) as engine:
        state = engine.snapshot().prompt_cache
        assert state.disk_corrupt == 3 and state.disk_entries == len(survivors)
        assert set(files(model_dir)) == survivors
        # A file that breaks after the index was built: found out at read time
        # (a prompt's end checkpoint: the next request for it reads it).
        victim = next(p for p in sorted(survivors) if read_metadata(p)[0]["0.kind"] == "user")
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        outs = run_all(
            engine, [token_request(f"r{i}", [*p, 7, 8], MAX_TOKENS) for i, p in enumerate(prompts)]
        )
        state = settled(engine).prompt_cache
    assert all(o.ok for o in outs)
    assert [o.tokens for o in outs] == [cold(model, tokenizer, [*p, 7, 8]) for p in prompts]
    assert state.disk_corrupt == 4 and not victim.exists()
    dropped = [r for r in caplog.records if "dropping the prompt-cache file" in r.getMessage()]
    assert len(dropped) == 4
    assert state.disk_hits >= 1  # the intact entries still served


def test_the_directory_stays_under_its_cap_and_a_lower_cap_applies_live(tmp_path, tiny_models):
    model_dir = tiny_models("qwen3_5")
    cache = tmp_path / "cache"
    # A 200-token qwen3_5 entry is about 116 KB: room for four.
    cap = 500_000
    keys = disk(tmp_path, disk_max_bytes=cap, max_entries=2)
    ids = [[(i * 37 + k) % 400 + 20 for k in range(200)] for i in range(8)]
    with running_engine(model_dir, prompt_cache=keys) as engine:
        outs = run_all(engine, [token_request(f"c{i}", p, 4) for i, p in enumerate(ids)])
    assert all(o.ok for o in outs)
    # Each request left one entry worth writing (its prompt's end): 8 written, 4 fit.
    assert 0 < len(files(cache)) < 8
    assert disk_bytes(cache) <= cap
    with running_engine(model_dir, prompt_cache=keys) as engine:
        lower = {**keys, "disk_max_bytes": cap // 2}
        engine.apply(load_settings(None, overrides={**_overrides(engine), "prompt_cache": lower}))
        for _ in range(500):
            if disk_bytes(cache) <= cap // 2:
                break
            time.sleep(0.01)
        state = settled(engine).prompt_cache
    assert 0 < disk_bytes(cache) <= cap // 2
    assert state.disk_max_bytes == cap // 2


def _overrides(engine) -> dict:
    s = engine.settings
    return {"model": {"path": s.model.path}, "server": {"state_dir": s.server.state_dir}}


def test_a_full_disk_turns_the_tier_off_and_requests_go_on(
    tmp_path, tiny_models, monkeypatch, caplog
):
    import mlxd.engine.chat.disk_writer as disk_writer

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(
        disk_writer.shutil, "disk_usage", lambda _: Usage(10 * 2**30, 10 * 2**30, 2**20)
    )
    caplog.set_level(logging.WARNING, logger="mlxd.engine.chat.prompt_disk")
    # Two entries in RAM: the others go to disk as they leave, while requests run.
    with running_engine(
        tiny_models("qwen3_5"), prompt_cache=disk(tmp_path, max_entries=2)
    ) as engine:
        ids = [[(i * 31 + k) % 400 + 20 for k in range(150)] for i in range(3)]
        outs = run_all(engine, [token_request(f"f{i}", p, 4) for i, p in enumerate(ids)])
        again = run_all(engine, [token_request("g", ids[2] + [9], 4)])
        state = settled(engine).prompt_cache
    assert all(o.ok for o in outs + again)
    assert state.disk_state == "failed" and "free" in (state.disk_error or "")
    assert state.disk_write_errors >= 1 and not files(tmp_path / "cache")
    assert any("disk tier is off" in r.getMessage() for r in caplog.records)


def test_two_engines_sharing_a_directory_leave_only_whole_files(tmp_path, tiny_models):
    model_dir = tiny_models("qwen3_5")
    keys = disk(tmp_path, max_entries=3)
    shared = next([(k * 13) % 400 + 20 for k in range(180)] for _ in range(1))
    with (
        running_engine(model_dir, prompt_cache=keys) as one,
        running_engine(model_dir, prompt_cache=keys) as two,
    ):

        async def both():
            jobs = []
            for i in range(6):
                mine = [(i * 41 + k) % 400 + 20 for k in range(160)]
                for engine, tag in ((one, "a"), (two, "b")):
                    jobs.append(consume(engine, token_request(f"{tag}{i}", [*shared, i], 4)))
                    jobs.append(consume(engine, token_request(f"{tag}{i}m", mine, 4)))
            return await asyncio.gather(*jobs)

        assert all(o.ok for o in asyncio.run(both()))
    written = files(tmp_path / "cache")
    assert written and not list((tmp_path / "cache").rglob(".*"))  # no temp files left
    for path in written:
        read_metadata(path)  # whole: header and size agree
    with running_engine(model_dir, prompt_cache=keys) as engine:
        assert engine.snapshot().prompt_cache.disk_corrupt == 0
        (out,) = run_all(engine, [token_request("x", [*shared, 2, 3], 4)])
    assert out.end.lookup.source == "disk" and out.end.usage.cached_tokens >= len(shared)  # type: ignore[union-attr]


def test_entries_survive_an_unload_and_a_swap_back_and_forth(tmp_path, tiny_models, tiny_loaded):
    model, tokenizer = tiny_loaded("qwen3_5")
    first = prompt(tokenizer, 220)
    keys = disk(tmp_path)
    with running_engine(tiny_models("qwen3_5"), prompt_cache=keys) as engine:
        assert run_all(engine, [token_request("a", first, 4)])[0].ok
        settings = engine.settings
        engine.unload().result(60)  # RAM entries go to disk first
        engine.load(settings).result(120)
        (after_unload,) = run_all(engine, [token_request("b", [*first, 5], MAX_TOKENS)])
        other = load_settings(
            None,
            overrides={
                "model": {"path": str(tiny_models("llama"))},
                "server": {"state_dir": settings.server.state_dir},
                "prompt_cache": keys,
            },
        )
        engine.load(other).result(120)
        assert run_all(engine, [token_request("c", first, 4)])[0].ok  # another model's cache
        engine.load(settings).result(120)
        (after_swap,) = run_all(engine, [token_request("d", [*first, 6], MAX_TOKENS)])
        state = settled(engine).prompt_cache
    for out, tail in ((after_unload, 5), (after_swap, 6)):
        assert isinstance(out.end, Finished) and out.end.lookup is not None
        assert out.end.lookup.source == "disk" and out.end.usage.cached_tokens >= len(first) - 1
        assert out.tokens == cold(model, tokenizer, [*first, tail])
    assert state.disk_corrupt == 0
    # Each model has its own directory under the same disk_dir.
    assert len({p.parent for p in files(tmp_path / "cache")}) == 2


def test_entries_are_written_through_so_a_crash_keeps_them(tmp_path, tiny_models, tiny_loaded):
    model, tokenizer = tiny_loaded("qwen3_5")
    first = prompt(tokenizer, 260)
    turn2 = [*first, 50, 51, 52, 53]
    keys = disk(tmp_path, disk_write_delay=0.2)
    crashed = tmp_path / "crashed"
    with running_engine(tiny_models("qwen3_5"), prompt_cache=keys) as engine:
        (warm,) = run_all(engine, [token_request("a", first, MAX_TOKENS)])
        # Written while the engine runs: what a kill -9 (or a power cut) leaves on disk.
        written = wait_for(lambda: files(tmp_path / "cache"), timeout=10)
        shutil.copytree(tmp_path / "cache", crashed)
    assert warm.ok and [read_metadata(p)[0]["0.kind"] for p in written] == ["user"]
    with running_engine(
        tiny_models("qwen3_5"), prompt_cache={**keys, "disk_dir": str(crashed)}
    ) as engine:
        (out,) = run_all(engine, [token_request("b", turn2, MAX_TOKENS)])
    assert isinstance(out.end, Finished)
    assert out.end.lookup is not None and out.end.lookup.source == "disk"
    assert out.end.usage.cached_tokens == len(first) - 1
    assert out.tokens == cold(model, tokenizer, turn2)


def test_a_garbled_payload_is_a_warning_and_a_miss_then_a_rewrite(
    tmp_path, tiny_models, tiny_loaded, caplog
):
    model, tokenizer = tiny_loaded("qwen3_5")
    first = prompt(tokenizer, 200)
    turn2 = [*first, 50, 51, 52, 53]
    with running_engine(tiny_models("qwen3_5"), prompt_cache=disk(tmp_path)) as engine:
        assert run_all(engine, [token_request("a", first, MAX_TOKENS)])[0].ok
    (entry,) = files(tmp_path / "cache")
    metadata, _ = read_metadata(entry)
    assert len(metadata["0.payload_blake2b"]) == 32
    verify_payload(entry, metadata["0.payload_blake2b"])
    # The header intact, bytes flipped in the tensors: it still loads, and would answer wrong.
    data = bytearray(entry.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    for i in range(8 + n + 64, len(data), 997):
        data[i] ^= 0x5A
    entry.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="mlxd.engine.chat.prompt_disk")
    with running_engine(tiny_models("qwen3_5"), prompt_cache=disk(tmp_path)) as engine:
        assert engine.snapshot().prompt_cache.disk_entries == 1  # the header reads fine
        (out,) = run_all(engine, [token_request("b", turn2, MAX_TOKENS)])
        state = settled(engine).prompt_cache
    assert isinstance(out.end, Finished) and out.end.lookup is not None
    assert out.end.lookup.source == "none" and out.end.usage.cached_tokens == 0
    assert out.tokens == cold(model, tokenizer, turn2)
    assert state.disk_corrupt == 1 and state.disk_hits == 0
    (warning,) = [r for r in caplog.records if "dropping the prompt-cache file" in r.getMessage()]
    assert "checksum" in warning.getMessage()
    # Prefilled again, the prompt is on disk again, whole (up to turn 2's end this time).
    (rewritten,) = files(tmp_path / "cache")
    assert read_metadata(rewritten)[0]["0.n_tokens"] == str(len(turn2) - 1)
    verify_payload(rewritten, read_metadata(rewritten)[0]["0.payload_blake2b"])
    with pytest.raises(CorruptEntry, match="no checksum"):
        verify_payload(rewritten, None)


def test_a_fifo_or_a_symlink_named_like_an_entry_does_not_delay_the_start(tmp_path, tiny_models):
    keys = disk(tmp_path)
    with running_engine(tiny_models("llama"), prompt_cache=keys) as engine:
        assert engine.snapshot().prompt_cache.disk_state == "on"
    (model_dir,) = (tmp_path / "cache").iterdir()
    os.mkfifo(model_dir / ("a" * 40 + ".safetensors"))  # a plain open() would wait for a writer
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"not ours")
    (model_dir / ("b" * 40 + ".safetensors")).symlink_to(outside)
    started = time.monotonic()
    with running_engine(tiny_models("llama"), prompt_cache=keys) as engine:
        state = engine.snapshot().prompt_cache
        (out,) = run_all(engine, [token_request("a", list(range(20, 60)), 2)])
    assert time.monotonic() - started < 30 and out.ok
    assert state.disk_state == "on" and state.disk_entries == 0 and state.disk_corrupt == 0
    assert outside.read_bytes() == b"not ours"  # left alone
    with pytest.raises(CorruptEntry, match="not a regular file"):
        read_metadata(model_dir / ("a" * 40 + ".safetensors"))
    with pytest.raises(CorruptEntry, match="symbolic link"):
        read_metadata(model_dir / ("b" * 40 + ".safetensors"))


def test_the_index_keeps_at_most_disk_max_entries(tmp_path, tiny_models):
    """The index is in memory: a count cap bounds it where the byte cap would not (N13)."""
    model_dir = tiny_models("llama")
    cache = tmp_path / "cache"
    keys = disk(tmp_path, disk_max_entries=3, max_entries=1)
    ids = [[(i * 37 + k) % 400 + 20 for k in range(200)] for i in range(6)]
    with running_engine(model_dir, prompt_cache=keys) as engine:
        outs = run_all(engine, [token_request(f"c{i}", p, 2) for i, p in enumerate(ids)])
        assert all(o.ok for o in outs)
        state = settled(engine).prompt_cache
        for _ in range(500):
            state = settled(engine).prompt_cache
            if state.disk_writes >= 4 and len(files(cache)) <= 3:
                break
            time.sleep(0.01)
    assert state.disk_writes >= 4, state
    assert 0 < state.disk_entries <= 3 and 0 < len(files(cache)) <= 3
    # A restart with a lower cap keeps the newest.
    newest = max(files(cache), key=lambda p: p.stat().st_mtime)
    with running_engine(model_dir, prompt_cache={**keys, "disk_max_entries": 1}) as engine:
        for _ in range(500):
            if files(cache) == [newest]:
                break
            time.sleep(0.01)
        assert settled(engine).prompt_cache.disk_entries == 1
    assert files(cache) == [newest]
