"""The prompt cache's pure parts: the token trie, checkpoint points, entry files, the state dir."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mlxd.config import default_state_dir
from mlxd.engine.chat.checkpoints import plan, segments, system_end
from mlxd.engine.chat.disk_writer import CorruptEntry, read_metadata, usage
from mlxd.engine.chat.prefix_trie import TokenTrie
from mlxd.engine.chat.prompt_disk import decode_tokens, encode_tokens, entry_name


@pytest.fixture
def trie() -> TokenTrie[str]:
    t: TokenTrie[str] = TokenTrie()
    t.add([1, 2, 3], "sys")
    t.add([1, 2, 3, 4, 5, 6], "turn")
    t.add([1, 2, 3, 4, 5, 6, 7, 8, 9], "answer")
    t.add([1, 9], "other")
    return t


def test_walk_takes_the_longest_true_prefix_and_says_where_the_prompt_left(trie):
    w = trie.walk([1, 2, 3, 4, 5, 6, 7, 0, 0], limit=8, rewindable=lambda v: False)
    assert (w.prefix, w.prefix_len, w.common, w.below) == ("turn", 6, 7, None)


def test_walk_offers_a_rewindable_entry_that_continues_past_the_divergence(trie):
    w = trie.walk([1, 2, 3, 4, 5, 6, 7, 0], limit=7, rewindable=lambda v: v == "answer")
    # "answer" (9 tokens) can be cut back to the 7 the prompt shares with it.
    assert (w.prefix_len, w.below, w.below_len, w.common) == (6, "answer", 9, 7)


def test_walk_never_takes_the_whole_prompt_and_reports_a_miss_at_zero(trie):
    # The stored "turn" is the whole prompt: the last token must still be fed.
    w = trie.walk([1, 2, 3, 4, 5, 6], limit=5, rewindable=lambda v: False)
    assert (w.prefix, w.prefix_len, w.common) == ("sys", 3, 6)
    assert trie.walk([7, 7], limit=1, rewindable=lambda v: True).common == 0


def test_pop_prunes_its_branch_and_prefixes_lists_stored_prefixes(trie):
    assert [n for n, _ in trie.prefixes([1, 2, 3, 4, 5, 6, 7, 8, 9])] == [3, 6]
    assert trie.pop([1, 2, 3, 4, 5, 6, 7, 8, 9]) == "answer"
    assert trie.pop([1, 2, 3, 4, 5, 6, 7, 8, 9]) is None
    assert len(trie) == 3 and trie._node([1, 2, 3, 4, 5, 6, 7]) is None
    assert sorted(trie.values()) == ["other", "sys", "turn"]


def test_plan_keeps_system_periodic_and_prompt_end_points_past_the_cached_prefix():
    got = plan(1000, 0, system_end=300, prompt_end=990, every=256)
    assert got == [(256, "checkpoint"), (300, "system"), (512, "checkpoint"),
                   (768, "checkpoint"), (990, "user")]  # fmt: skip
    # A cached prefix hides earlier points; the last token is never a point.
    assert plan(1000, 600, system_end=300, prompt_end=999, every=0) == [(999, "user")]
    # Where points fall together the more valuable kind wins.
    assert plan(600, 0, system_end=512, prompt_end=None, every=256) == [
        (256, "checkpoint"),
        (512, "system"),
    ]


def test_segments_cut_the_rest_of_a_prompt_at_absolute_positions():
    rest = list(range(10, 20))  # tokens 10..19 of a prompt, 10 already cached
    assert segments(rest, 10, [12, 19]) == [[10, 11], list(range(12, 19)), [19]]
    assert segments(rest, 10, []) == [rest]


def test_system_end_is_where_the_rendered_system_part_stops_matching():
    prompt = [1, 2, 3, 4, 9, 9]
    assert system_end(prompt, [1, 2, 3, 4, 5]) == 4
    assert system_end(prompt, [7]) is None  # nothing shared
    assert system_end(prompt, prompt) is None  # not a point inside the prompt


def test_tokens_round_trip_and_name_their_entry():
    tokens = [0, 5, 151_000, 2**31 - 1]
    assert decode_tokens(encode_tokens(tokens)) == tokens
    assert entry_name(tokens) != entry_name(tokens[:-1])
    assert entry_name(tokens).endswith(".safetensors")


def _entry(path: Path, metadata: dict, data: bytes = b"\0" * 8, declared: int = 8) -> Path:
    header = json.dumps(
        {
            "__metadata__": metadata,
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, declared]},
        }
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_read_metadata_accepts_a_whole_file_and_refuses_a_truncated_or_garbled_one(tmp_path):
    good = _entry(tmp_path / "good.safetensors", {"0.kind": "user"})
    assert read_metadata(good) == ({"0.kind": "user"}, good.stat().st_size)
    short = _entry(tmp_path / "short.safetensors", {}, data=b"\0" * 4)
    long = _entry(tmp_path / "long.safetensors", {}, data=b"\0" * 12)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 40)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    for bad in (short, long, garbage, empty):
        with pytest.raises(CorruptEntry):
            read_metadata(bad)


def test_usage_lists_every_models_entries_and_removes_stale_temp_files(tmp_path):
    a, b = tmp_path / "model-a", tmp_path / "model-b"
    a.mkdir(), b.mkdir()
    _entry(a / "x.safetensors", {})
    _entry(b / "y.safetensors", {})
    fresh, stale = a / ".x.1.tmp", b / ".y.2.tmp"
    fresh.write_bytes(b"partial")
    stale.write_bytes(b"partial")
    files = usage(tmp_path, now=stale.stat().st_mtime + 7200)
    assert sorted(p.name for _, _, p in files) == ["x.safetensors", "y.safetensors"]
    assert not stale.exists() and not fresh.exists()  # both older than an hour at "now"
    assert usage(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("platform", "env", "expected"),
    [
        ("darwin", {"HOME": "/Users/a"}, "/Users/a/Library/Application Support/mlxd"),
        ("linux", {"HOME": "/home/a"}, "/home/a/.local/state/mlxd"),
        ("linux", {"HOME": "/home/a", "XDG_STATE_HOME": "/var/st"}, "/var/st/mlxd"),
        ("linux", {"HOME": "/home/a", "XDG_STATE_HOME": "rel"}, "/home/a/.local/state/mlxd"),
    ],
)
def test_the_default_state_dir_follows_the_platform(platform, env, expected):
    assert default_state_dir(platform, env) == Path(expected)
