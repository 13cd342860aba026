"""The radix token trie against a brute-force model of it, and what it costs per token."""

from __future__ import annotations

import random
import tracemalloc

from mlxd.engine.chat.prefix_trie import TokenTrie


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_trie_answers_as_a_brute_force_search_does():
    rng = random.Random(7)
    for _ in range(30):
        trie: TokenTrie[str] = TokenTrie()
        stored: dict[tuple[int, ...], str] = {}
        for step in range(120):
            seq = [rng.randint(1, 3) for _ in range(rng.randint(1, 9))]
            if rng.random() < 0.3 and stored:
                seq = list(rng.choice(list(stored)))
                assert trie.pop(seq) == stored.pop(tuple(seq))
            else:
                value = f"v{step}"
                assert trie.add(seq, value) == stored.get(tuple(seq))
                stored[tuple(seq)] = value
            assert len(trie) == len(stored)
            prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, 12))]
            limit = rng.randint(0, len(prompt))
            rewindable = {v for v in stored.values() if int(v[1:]) % 2 == 0}
            w = trie.walk(prompt, limit=limit, rewindable=rewindable.__contains__)
            common = max((shared(list(s), prompt) for s in stored), default=0)
            prefixes = [s for s in stored if list(s) == prompt[: len(s)] and len(s) <= limit]
            best = max(prefixes, key=len, default=())
            assert (w.common, w.prefix_len) == (common, len(best))
            assert w.prefix == stored.get(best)
            if min(common, limit) > len(best):
                below = [
                    s
                    for s in stored
                    if list(s[:common]) == prompt[:common] and stored[s] in rewindable
                ]
                shortest = min((len(s) for s in below), default=0)
                assert w.below_len == shortest
                assert (w.below is None) == (not below)
                if below:
                    assert w.below in {stored[s] for s in below if len(s) == shortest}
            strict = sorted(
                len(s) for s in stored if 0 < len(s) < len(prompt) and list(s) == prompt[: len(s)]
            )
            assert [n for n, _ in trie.prefixes(prompt)] == strict
            assert sorted(trie.values()) == sorted(stored.values())
            for s, v in stored.items():
                assert trie.get(list(s)) == v


def test_an_index_of_long_prompts_costs_bytes_per_token_not_hundreds():
    rng = random.Random(1)
    system = [rng.randrange(50_000) for _ in range(200)]
    prompts = [system + [rng.randrange(50_000) for _ in range(300)] for _ in range(200)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie: TokenTrie[int] = TokenTrie()
    for i, p in enumerate(prompts):
        trie.add(p, i)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    tokens = 200 + 200 * 300
    # A dict per token took about 250 bytes a token; a run of 8-byte tokens, about 8.
    assert used / tokens < 20, used / tokens
