"""Every admitted request learns what the prompt cache held, on a real engine and tiny models.

A KV model (llama: its cache can be trimmed back to any shared prefix) and a
hybrid one (qwen3_5: linear attention plus KV, reused only from an entry that
is a true prefix of the new prompt). The lookup comes as the ``Admitted``
event, before the first token, in both lanes; its ``diverged_at`` is where
the prompt left everything the cache held, so on the hybrid a prompt that
shares a long prefix with an entry it cannot reuse says so
(``cached_tokens < diverged_at``).
"""

from __future__ import annotations

import pytest

from mlxd.engine.chat.lookups import SNIPPET_CHARS, SNIPPET_TOKENS
from mlxd.engine.messages import Accepted, SamplingParams
from tests.support.engine import run_all, running_engine, token_request
from tests.support.tinymodels import tiny_model_dir

BASE = list(range(10, 210))


@pytest.mark.parametrize(("family", "trimmable"), [("llama", True), ("qwen3_5", False)])
def test_each_turn_says_how_much_was_reused_and_where_it_diverged(
    family: str, trimmable: bool, tiny_loaded
) -> None:
    _, tokenizer = tiny_loaded(family)
    with running_engine(tiny_model_dir(family), batch={"size": 2}) as engine:
        first = run_all(engine, [token_request("t1", BASE, 6)])[0]
        assert first.ok and first.lookup is not None
        assert (first.lookup.cached_tokens, first.lookup.source) == (0, "none")
        assert first.lookup.stored == 0  # an empty cache, not a changed prompt
        assert first.lookup.diverged_at == 0 and first.lookup.before == ""
        assert first.lookup.after == tokenizer.decode(BASE[:SNIPPET_TOKENS])[:SNIPPET_CHARS]

        # Turn 2 extends turn 1 (prompt + answer): all of it is reused, on both families.
        turn2 = [*BASE, *first.tokens, 5, 6, 7]
        second = run_all(engine, [token_request("t2", turn2, 6)])[0]
        held = len(BASE) + len(first.tokens)
        assert second.lookup is not None
        assert (second.lookup.cached_tokens, second.lookup.source) == (held, "ram")
        assert second.lookup.diverged_at == held and second.lookup.stored >= 1
        assert second.end is not None and second.end.usage.cached_tokens == held

        # A prompt that shares the first 100 tokens, then differs.
        other = [*BASE[:100], *[99] * 40]
        third = run_all(engine, [token_request("t3", other, 6)])[0]
        lookup = third.lookup
        assert lookup is not None and lookup.diverged_at == 100
        assert lookup.before == tokenizer.decode(BASE[100 - SNIPPET_TOKENS : 100])[-SNIPPET_CHARS:]
        assert lookup.after == tokenizer.decode([99] * SNIPPET_TOKENS)[:SNIPPET_CHARS]
        if trimmable:
            assert (lookup.cached_tokens, lookup.source) == (100, "ram")
        else:
            # Shared, but the hybrid's state cannot be rewound to token 100: nothing reused.
            assert (lookup.cached_tokens, lookup.source) == (0, "none")

        snap = engine.snapshot().prompt_cache
        assert [r.request_id for r in snap.lookups] == ["t3", "t2", "t1"]
        assert snap.ram_tokens == held + lookup.cached_tokens
        assert snap.lookups[0].diverged_at == 100 and snap.lookups[0].api == "chat"


def test_the_serial_lane_and_a_full_hit() -> None:
    with running_engine(tiny_model_dir("llama"), batch={"size": 2}) as engine:
        seeded = SamplingParams(temperature=0.0, seed=3)  # a seed runs in the serial lane
        first = run_all(engine, [token_request("s1", BASE, 4, sampling=seeded)])[0]
        again = run_all(engine, [token_request("s2", BASE, 4, sampling=seeded)])[0]
        assert isinstance(first.accepted, Accepted) and first.accepted.lane == "serial"
        assert first.lookup is not None and first.lookup.cached_tokens == 0
        # The same prompt: everything but the token generation must feed, no divergence.
        assert again.lookup is not None
        assert again.lookup.cached_tokens == len(BASE) - 1
        assert again.lookup.diverged_at is None and again.lookup.before == ""
        assert again.tokens == first.tokens


def test_with_the_cache_off_the_lookup_says_so() -> None:
    with running_engine(
        tiny_model_dir("llama"), batch={"size": 2}, prompt_cache={"max_entries": 0}
    ) as engine:
        outs = run_all(engine, [token_request(f"o{i}", BASE, 4) for i in range(2)])
        for out in outs:
            assert out.lookup is not None
            assert (out.lookup.source, out.lookup.cached_tokens) == ("off", 0)
            assert out.lookup.diverged_at is None and out.lookup.before == ""
