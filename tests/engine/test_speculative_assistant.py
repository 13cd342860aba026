"""``[speculative] mode = "draft"`` with a Gemma 4 assistant: drafts from the target's state.

A tiny random ``gemma4_text`` target (sliding-window and full-attention layers, a
window shorter than the rows) and a tiny assistant for it (tests/support/tinygemma4.py):
the random assistant's drafts are mostly rejected (greedy output must not change);
the echo assistant drafts what the bigram target will choose (nearly all accepted).
The port's drafts are held equal to mlx-vlm's reference drafter's on the same state.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import mlx.core as mx
import pytest

from mlxd.engine.chat.loading import ModelLoadError
from tests.engine.test_speculative_mtp import (
    assert_same_output_and_drafted,
    formula_costs,
)
from tests.engine.test_speculative_mtp import waves as mtp_waves
from tests.support.tinygemma4 import tiny_assistant_dir, tiny_gemma4_dir

__all__ = ["formula_costs"]  # autouse here too: the cost model's formula only


def waves(echo: bool, mode: str):
    """Four rows at once, then one alone (test_speculative_mtp's waves), with or without
    the assistant; (outputs, counters, weights bytes)."""
    extra = {"draft_model": str(tiny_assistant_dir(echo=echo))} if mode == "draft" else {}
    return mtp_waves(tiny_gemma4_dir(echo=echo), mode, **extra)


@pytest.mark.parametrize("echo", [False, True], ids=["random", "echo"])
def test_greedy_output_with_the_assistant_equals_speculation_off(echo):
    assert_same_output_and_drafted(waves(echo, "off"), waves(echo, "draft"), echo)


def _loaded(model_dir):
    from mlxd.config import ModelSettings
    from mlxd.engine.chat.loading import load_model

    return load_model(ModelSettings(path=str(model_dir)), optimized_blas=False, generation=0)


def _assistant(loaded, path):
    from mlxd.config import SpeculativeSettings
    from mlxd.engine.chat.speculative.drafter import attach_draft

    return attach_draft(loaded, SpeculativeSettings(mode="draft", draft_model=str(path)))


@pytest.mark.parametrize("ordered", [False, True], ids=["dense-head", "centroid-head"])
def test_the_drafts_equal_mlx_vlms_reference_drafter(ordered):
    """Two rows of different lengths (one past the sliding window) in one batch cache: each
    row's drafts are what mlx-vlm's drafter makes from that row's own cache (with the E2B/E4B
    assistants' centroid-routed head too)."""
    reference = pytest.importorskip("mlx_vlm.speculative.drafters.gemma4_assistant")
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.chat.speculative.assistant import AssistantDrafter

    path = tiny_assistant_dir(ordered=ordered)
    loaded = _assistant(_loaded(tiny_gemma4_dir()), path)
    model, target = loaded.draft, loaded.model
    drafter = AssistantDrafter(model)
    ref = reference.Model(reference.ModelConfig.from_dict(_config(path)))
    weights = mx.load(str(path / "model.safetensors"))
    assert isinstance(weights, dict)
    ref.load_weights(list(ref.sanitize(weights).items()))
    ref.bind(target)

    prompts = [list(range(40, 64)), list(range(70, 81))]  # 24 tokens (window 16) and 11
    solo = []
    for tokens in prompts:
        cache = make_prompt_cache(target)
        hidden, logits = model.forward(mx.array([tokens]), cache)
        pending = cast("int", mx.argmax(logits[0, -1]).item())
        solo.append((cache, hidden[:, -1:, :], pending))
    caches = [cls.merge([c[0][i] for c in solo]) for i, cls in enumerate(_batch_types(solo))]
    batch = SimpleNamespace(
        uids=[0, 1],
        prompt_cache=caches,
        tokens=[list(p) for p in prompts],
        _next_tokens=mx.array([s[2] for s in solo]),
    )
    hidden = mx.concatenate([s[1] for s in solo], axis=0)  # rows x 1 x hidden
    drafter._hidden = hidden
    drafter.observe(batch, [0, 1], [[], []], [0, 0])  # type: ignore[arg-type]
    drafter.attend(batch)  # type: ignore[arg-type]
    for uid, (cache, last, pending) in enumerate(solo):
        mine = drafter.propose(uid, prompts[uid], pending, 3)
        shared = {kind: tuple(cache[i].state[:2]) for kind, i in model.layers.items()}
        ref.set_shared_kv(shared, cache[0].offset)
        theirs = ref.draft_block(
            pending, last, None, 4, lambda x: mx.argmax(x, axis=-1), greedy=True
        )
        assert mine == theirs[0].tolist() and len(mine) == 3
        # The first step's logits too (tokens alone would hide a key more or less).
        shared_mine = drafter._shared(uid)
        assert shared_mine is not None and shared_mine[1] == len(prompts[uid])
        embeds = model.embed(mx.array([[pending]]))
        h, _ = model.module(embeds, last, *shared_mine)
        at = mx.array([[len(prompts[uid])]])
        _, ref_h = ref._forward_hidden(mx.concatenate([embeds, last], axis=-1), shared, at)
        assert mx.allclose(h, ref_h, atol=1e-5).item()
    # Not current (another pending token, or a length the row no longer has): no draft.
    assert drafter.propose(0, prompts[0], solo[0][2] + 1, 3) == []
    assert drafter.propose(1, prompts[1][:-1], solo[1][2], 3) == []


def _batch_types(solo):
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache

    return [BatchKVCache if type(c) is KVCache else BatchRotatingKVCache for c in solo[0][0]]


def _config(path):
    import json

    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"hidden_size_target": 32}, "is for a target of hidden size 32, not 64"),
        ({"vocab_size": 100}, "has a vocabulary of 100"),
        ({"head_dim": 8}, "attends with 4 heads of 8 on sliding_attention layers"),
        ({"sliding_window": 8}, "has a sliding window of 8, its target 16"),
    ],
    ids=["hidden", "vocab", "head-dim", "window"],
)
def test_a_mismatched_assistant_is_refused_at_load_naming_it(tmp_path, change, why):
    import json
    import shutil

    path = tmp_path / "assistant"
    shutil.copytree(tiny_assistant_dir(), path)
    config = _config(path)
    hidden = change.pop("hidden_size_target", None)
    if hidden is not None:
        config["backbone_hidden_size"] = hidden
    config["text_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=why) as caught:
        _assistant(_loaded(tiny_gemma4_dir()), path)
    assert str(path) in str(caught.value) and "Gemma 4 assistant" in str(caught.value)


def test_an_assistant_for_another_family_is_refused(tiny_models):
    with pytest.raises(ModelLoadError, match="drafts for Gemma 4 text models") as caught:
        _assistant(_loaded(tiny_models("llama")), tiny_assistant_dir())
    assert "'llama' model" in str(caught.value)
