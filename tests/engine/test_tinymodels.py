"""The tiny random-weight models load with mlx-lm, generate, and batch exactly like serial."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache

from tests.support import tinymodels
from tests.support.tinymodels import (
    EOS_TOKEN,
    FAMILIES,
    SLIDING_WINDOW,
    SPECIAL_TOKENS,
    build_tiny_model,
    expected_cache_layout,
    tiny_model_dir,
)

# Short, medium and long prompts: with the chat template they are 13, 39 and 125 tokens,
# so gemma3's 16-token sliding window rotates during prefill and during decode.
PROMPTS = (
    "Hi!",
    "Tell me about the river that runs past the old mill in the morning, please.",
    "Summarise this: the boats rock gently at their ropes, the fishermen mend their nets, "
    "the children play on the wooden pier, a dog barks somewhere in the hills, and the last "
    "bus leaves the square at ten o'clock sharp, full of tired workers going home.",
)
MAX_TOKENS = 24


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    )


def _describe(cache: Any) -> str:
    if isinstance(cache, CacheList):
        return f"CacheList({','.join(type(c).__name__ for c in cache.caches)})"
    return type(cache).__name__


def _serial(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


def _batched(
    model: Any,
    prompts: Sequence[list[int]],
    eos_ids: set[int],
    max_tokens: int,
    late_after: int,
) -> list[list[int]]:
    """Greedy tokens per prompt; the last prompt joins after ``late_after`` decode steps."""
    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[e] for e in sorted(eos_ids)])
    try:
        uids = gen.insert(list(prompts[:-1]))
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        late_uid = None
        for step in range(10 * max_tokens):
            if step == late_after:
                assert all(0 < len(out[uid]) < max_tokens for uid in uids)
                late_uid = gen.insert([prompts[-1]])[0]
                out[late_uid] = []
            responses = gen.next_generated()
            if not responses and late_uid is not None:
                break
            for r in responses:
                out[r.uid].append(r.token)
    finally:
        gen.close()
    assert late_uid is not None
    return [out[uid] for uid in [*uids, late_uid]]


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_with_expected_cache_layout(family: str, tiny_loaded: Any) -> None:
    model, tokenizer = tiny_loaded(family)
    caches = make_prompt_cache(model)
    assert [_describe(c) for c in caches] == expected_cache_layout(family)
    windows = {c.max_size for c in caches if isinstance(c, RotatingKVCache)}
    assert windows == ({SLIDING_WINDOW} if family == "gemma3_text" else set())
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(EOS_TOKEN)}
    params = [v for _, v in tree_flatten(model.parameters())]
    assert {p.dtype for p in params} == {mx.float32}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_is_varied(family: str, tiny_loaded: Any) -> None:
    model, tokenizer = tiny_loaded(family)
    outputs = []
    for text in PROMPTS:
        tokens = _serial(model, tokenizer, _chat_ids(tokenizer, text), 16)
        assert len(tokens) >= 10
        assert len(set(tokens)) >= 3
        outputs.append(tokens)
    assert len({tuple(t) for t in outputs}) == len(PROMPTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_generator_matches_serial(family: str, tiny_loaded: Any) -> None:
    model, tokenizer = tiny_loaded(family)
    prompts = [_chat_ids(tokenizer, text) for text in PROMPTS]
    assert len(prompts[0]) < SLIDING_WINDOW < len(prompts[1]) < len(prompts[2])
    serial = [_serial(model, tokenizer, p, MAX_TOKENS) for p in prompts]
    batched = _batched(model, prompts, tokenizer.eos_token_ids, MAX_TOKENS, late_after=3)
    assert batched == serial
    assert all(len(t) == MAX_TOKENS for t in serial)


ROUND_TRIP_TEXTS = (
    "Hello, world!",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "naïve café — 東京 🚀 ümlaut",
    "Numbers 3.14159 and 2048, symbols {}[]<>|\\",
    "literal <|im_end|> inside text",
    "",
)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips(family: str, tiny_loaded: Any) -> None:
    _, tokenizer = tiny_loaded(family)
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_chat_template_and_special_tokens(tiny_loaded: Any) -> None:
    _, tokenizer = tiny_loaded("llama")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    special = {tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(special) == len(SPECIAL_TOKENS)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text
    assert 400 <= tokenizer.vocab_size <= 1000


def test_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    def files(path: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}

    a = files(build_tiny_model("llama", tmp_path / "a"))
    b = files(build_tiny_model("llama", tmp_path / "b"))
    c = files(build_tiny_model("llama", tmp_path / "c", seed=1))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]
    assert set(a) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_llama_b_is_a_different_llama(tiny_loaded: Any, tiny_models: Any) -> None:
    a = json.loads((tiny_models("llama") / "config.json").read_text())
    b = json.loads((tiny_models("llama_b") / "config.json").read_text())
    assert a["model_type"] == b["model_type"] == "llama"
    assert a["hidden_size"] != b["hidden_size"]
    (model_a, tok), (model_b, _) = tiny_loaded("llama"), tiny_loaded("llama_b")
    prompt = _chat_ids(tok, PROMPTS[1])
    assert _serial(model_a, tok, prompt, 12) != _serial(model_b, tok, prompt, 12)


def test_lower_precision_build_loads(tiny_loaded: Any) -> None:
    model, tokenizer = tiny_loaded("qwen3_5", dtype="bfloat16")
    params = dict(tree_flatten(model.parameters()))
    assert params["language_model.model.embed_tokens.weight"].dtype == mx.bfloat16
    # qwen3_5 keeps A_log in float32, as mlx-lm's convert does.
    assert {v.dtype for k, v in params.items() if k.endswith("A_log")} == {mx.float32}
    assert len(_serial(model, tokenizer, _chat_ids(tokenizer, "Hi"), 8)) == 8


def test_tiny_model_dir_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path))
    first = tiny_model_dir("mamba2")
    assert first.is_relative_to(tmp_path / "tiny-models" / tinymodels.CONTENT_VERSION)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir("mamba2") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert tiny_model_dir("mamba2", seed=3) != first
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".")] == []


def test_tiny_model_dir_survives_losing_a_build_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = tinymodels.build_tiny_model
    winner: list[Path] = []

    def racing_build(family: str, out_dir: Path, **kw: Any) -> Path:
        # Another process finishes and renames its build into place while we build.
        final = out_dir.parent / out_dir.name[1:].rsplit(".", 1)[0]
        real_build(family, final, **kw)
        winner.append(final)
        return real_build(family, out_dir, **kw)

    monkeypatch.setattr(tinymodels, "build_tiny_model", racing_build)
    path = tiny_model_dir("llama", cache_dir=tmp_path)
    assert winner == [path]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


@pytest.mark.parametrize("tiny_model_path", ["falcon_h1"], indirect=True)
def test_indirect_fixture_picks_family(tiny_model_path: Path) -> None:
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["model_type"] == "falcon_h1"


def test_unknown_family_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model family"):
        build_tiny_model("gpt5", tmp_path)
