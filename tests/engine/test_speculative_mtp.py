"""``[speculative] mode = "mtp"``: a GLM-4.5 or DeepSeek-V3 model drafts with the MTP layer
of its checkpoint.

A tiny random ``glm4_moe`` (or ``glm4_moe_lite``, ``deepseek_v3``) carries an MTP layer
(tests/support/tinymtp.py):
with random weights its drafts are mostly rejected (the mechanics run and
greedy output must not change); its "echo" variant is a bigram model whose
MTP layer predicts what the target will choose, so drafts are accepted.
"""

from __future__ import annotations

import functools
import json
import shutil
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxd.engine.chat.loading import ModelLoadError
from mlxd.engine.policy.spec_depth import StepCosts
from tests.engine.test_speculative import WIDE, full_depth
from tests.support.engine import run_all, running_engine, settled, token_request
from tests.support.tinymtp import tiny_mtp_dir, tiny_qwen_mtp_dir

MAX_TOKENS = 16
TEXTS = [
    "The river runs past the old mill.",
    "A small computer reads a prompt and predicts.",
    "Memory grows with every token.",
    "one two three one two three",
]


@pytest.fixture(autouse=True)
def formula_costs(monkeypatch):
    """The cost model's formula only: step times measured on a shared CPU would vary."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, rows, width: None)


@functools.cache
def tokenizer_of(model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(model_dir)


def waves(model_dir, mode: str, **extra: str):
    """Four rows at once, then one alone, in one engine; (outputs, counters, weights bytes).

    ``extra``: more ``[speculative]`` keys (a ``draft_model``); also used by
    test_speculative_assistant.py.
    """
    spec = {"mode": mode, "max_draft_tokens": 3, **WIDE, **extra}
    with (
        full_depth(True),
        running_engine(
            model_dir, batch={"size": 4, "prompt_concurrency": 4}, speculative=spec
        ) as engine,
    ):
        tokenizer = tokenizer_of(model_dir)
        four = run_all(
            engine,
            [token_request(f"r{i}", tokenizer.encode(t), MAX_TOKENS) for i, t in enumerate(TEXTS)],
        )
        solo = run_all(engine, [token_request("solo", tokenizer.encode(TEXTS[1]), MAX_TOKENS)])
        counters = dict(settled(engine).counters)
        assert engine.info is not None
        weights = engine.info.weights_bytes
    return [o.tokens for o in [*four, *solo]], counters, weights


def assert_same_output_and_drafted(off_run, on_run, echo: bool) -> None:
    """``waves`` off and on: the same greedy output, drafts verified, an echo drafter's
    accepted (>= 80%, several tokens a step), and the drafter's weights counted in the
    model's (also for test_speculative_assistant.py)."""
    (off, off_counters, off_weights), (on, counters, weights) = off_run, on_run
    assert on == off
    assert all(len(t) == MAX_TOKENS for t in off)
    assert off_counters["spec_drafted_tokens"] == 0
    drafted, accepted = counters["spec_drafted_tokens"], counters["spec_accepted_tokens"]
    assert drafted > 0 and counters["spec_verify_steps"] > 0
    if echo:  # the drafter predicts the target: drafts accepted, several tokens a step
        assert accepted >= 0.8 * drafted, (accepted, drafted)
        assert counters["spec_verify_steps"] < sum(len(t) for t in on) / 2
    assert weights > off_weights


@pytest.mark.parametrize(
    ("family", "echo"),
    # glm4_moe's echo variant runs in tests/http/test_speculative_mtp.py.
    # glm4_moe_lite and deepseek_v3: MLA attention.
    # deepseek_v32: also a sparse-attention indexer, its own cache beside (CacheList).
    [
        ("glm4_moe", False),
        ("glm4_moe_lite", True),
        ("deepseek_v3", False),
        ("deepseek_v3", True),
        ("deepseek_v32", False),
        ("deepseek_v32", True),
    ],
    ids=lambda v: v if isinstance(v, str) else ("echo" if v else "random"),
)
def test_greedy_output_with_the_mtp_head_equals_speculation_off(family, echo):
    model_dir = tiny_mtp_dir(family, echo=echo)
    # The head's weights count in the model's: one decoder layer and three small tensors.
    assert_same_output_and_drafted(waves(model_dir, "off"), waves(model_dir, "mtp"), echo)


def _loaded(model_dir):
    from mlxd.config import ModelSettings
    from mlxd.engine.chat.loading import load_model

    return load_model(ModelSettings(path=str(model_dir)), optimized_blas=False, generation=0)


def test_the_mtp_head_loads_from_the_checkpoint_and_its_bytes_count():
    from mlxd.config import SpeculativeSettings
    from mlxd.engine.chat.speculative.mtp_loading import attach_mtp

    loaded = _loaded(tiny_mtp_dir())
    with_head = attach_mtp(loaded, SpeculativeSettings(mode="mtp"))
    head = with_head.draft
    arrays = [v for _, v in tree_flatten(head.module.parameters()) if isinstance(v, mx.array)]
    assert head.weights_bytes == sum(a.nbytes for a in arrays) > 0
    assert with_head.weights_bytes == loaded.weights_bytes + head.weights_bytes
    assert with_head.info.weights_bytes == loaded.info.weights_bytes + head.weights_bytes
    # The experts were stacked as the target's are; the shared embedding and head not copied.
    names = {k for k, _ in tree_flatten(head.module.parameters())}
    assert "block.mlp.switch_mlp.gate_proj.weight" in names
    assert not any("embed" in k or "shared_head.head" in k for k in names)
    # head(trunk(x)) is the target's own forward.
    x = mx.array([[5, 9, 12]])
    assert mx.allclose(head.head(head.trunk(x, None)), loaded.model(x), atol=1e-5)
    assert attach_mtp(loaded, SpeculativeSettings(mode="off")) is loaded


def test_a_model_without_an_mtp_head_is_refused_naming_it(tiny_models, tmp_path):
    from mlxd.engine.chat.speculative.mtp_loading import load_mtp

    broken = tmp_path / "broken-mtp"  # its MTP layer lacks eh_proj
    shutil.copytree(tiny_mtp_dir(), broken)
    arrays = mx.load(str(broken / "model.safetensors"))
    assert isinstance(arrays, dict)
    del arrays["model.layers.2.eh_proj.weight"]
    mx.save_safetensors(str(broken / "model.safetensors"), arrays)
    bare_deepseek = tiny_mtp_dir("deepseek_v3", with_mtp=False)
    kimi = tmp_path / "kimi-k2"  # DeepSeek-V3's architecture, no MTP layer, its own name
    no_nextn = tmp_path / "no-nextn"
    for copy, config in ((kimi, {"model_type": "kimi_k2"}), (no_nextn, {})):
        shutil.copytree(bare_deepseek, copy)
        written = json.loads((copy / "config.json").read_text())
        written.update(config, num_nextn_predict_layers=0)
        (copy / "config.json").write_text(json.dumps(written))
    for model_dir, why in (
        (tiny_mtp_dir(with_mtp=False), "has no MTP weights"),
        (bare_deepseek, r"has no MTP weights \(model\.layers\.2\.\*"),
        (no_nextn, "has no MTP layer .its config.json sets num_nextn_predict_layers = 0"),
        (kimi, "is a 'kimi_k2' model: mlxd runs the MTP heads of deepseek_v3, deepseek_v32"),
        (tiny_models("llama"), "is a 'llama' model"),
        (broken, "has MTP weights this build cannot read"),
    ):
        with pytest.raises(ModelLoadError, match=why) as caught:
            load_mtp(_loaded(model_dir))
        assert 'mode = "mtp"' in str(caught.value) and model_dir.name in str(caught.value)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_qwen_mtp_head_drafts_what_its_target_will_choose(family):
    """A ``mtp.*`` head (hybrid target): loaded, and its drafts are the target's tokens.

    The batch does not speculate on hybrid caches until their rollback exists, so the
    drafter is driven by hand here: the target's forward keeps the hidden state, the
    row's pair is observed, and the echo head's three drafts are the target's next three.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.config import SpeculativeSettings
    from mlxd.engine.chat.speculative.mtp import MtpDrafter
    from mlxd.engine.chat.speculative.mtp_head import QwenMtp
    from mlxd.engine.chat.speculative.mtp_loading import attach_mtp

    model_dir = tiny_qwen_mtp_dir(family, echo=True)
    loaded = attach_mtp(_loaded(model_dir), SpeculativeSettings(mode="mtp"))
    head, model = loaded.draft, loaded.model
    assert isinstance(head.module, QwenMtp) and head.layers == 1
    x = mx.array([[5, 9, 12]])
    assert mx.allclose(head.head(head.trunk(x, None)), model(x), atol=1e-5)

    prompt = tokenizer_of(model_dir).encode(TEXTS[0])
    cache = make_prompt_cache(model)
    head.trunk(mx.array([prompt[:-1]]), cache)
    drafter = MtpDrafter(head)
    pending = int(mx.argmax(drafter.forward(mx.array([prompt[-1:]]), cache)[0, -1]).item())
    batch = SimpleNamespace(uids=[7], tokens=[prompt], _next_tokens=mx.array([pending]))
    drafter.observe(batch, [7], [[]], [0])  # type: ignore[arg-type]
    draft = drafter.propose(7, prompt, pending, 3)
    expected, y = [], pending
    for _ in range(3):
        y = int(mx.argmax(model(mx.array([[y]]), cache=cache)[0, -1]).item())
        expected.append(y)
    assert draft == expected
    assert drafter.propose(7, prompt, pending, 3) == []  # its pair was used: none until observed


def test_mode_mtp_on_a_hybrid_qwen3_5_gives_the_same_greedy_output():
    """Hybrid caches roll back per row (rollback.py), so its echo head drafts and the
    drafts are accepted."""
    model_dir = tiny_qwen_mtp_dir(echo=True)
    off, _, _ = waves(model_dir, "off")
    on, counters, _ = waves(model_dir, "mtp")
    assert on == off
    assert counters["spec_drafted_tokens"] > 0
    assert counters["spec_accepted_tokens"] >= 0.8 * counters["spec_drafted_tokens"]


def test_a_rows_head_cache_keeps_verified_positions_and_starts_afresh_after_a_gap():
    from mlxd.config import SpeculativeSettings
    from mlxd.engine.chat.speculative.mtp import MtpDrafter
    from mlxd.engine.chat.speculative.mtp_loading import attach_mtp

    head = attach_mtp(_loaded(tiny_mtp_dir()), SpeculativeSettings(mode="mtp")).draft
    drafter = MtpDrafter(head)
    size = head.module.eh_proj.weight.shape[0]
    tokens = [3, 4, 5, 6]

    def verified(width: int, drafted: list[int], took: int, pending: int) -> None:
        """A verify step of ``width`` positions kept ``took`` drafted tokens, then ``pending``."""
        drafter._hidden = mx.random.normal((1, width, size))
        tokens.extend([*drafted[:took]])
        batch = SimpleNamespace(uids=[1], tokens=[tokens], _next_tokens=mx.array([pending]))
        drafter.observe(batch, [1], [drafted], [took])  # type: ignore[arg-type]

    def offset() -> int:
        return drafter._rows[1].cache[0].offset

    tokens.append(7)  # the pending token a first verify step fed (no draft yet)
    verified(1, [], 0, 8)
    first = drafter.propose(1, tokens, 8, 3)
    assert len(first) == 3 and offset() == 1  # the guesses' entries cut off again
    assert drafter.propose(1, tokens, 8, 3) == []  # used: none until the next verify
    tokens.append(8)
    verified(4, first, 1, 11)  # kept one drafted token: two verified pairs
    assert len(drafter.propose(1, tokens, 11, 2)) == 2 and offset() == 1 + 2
    tokens.extend([11, 12, 13])  # plain steps: no pairs
    assert drafter.propose(1, tokens, 14, 2) == []
    tokens.append(14)
    verified(1, [], 0, 15)  # a gap behind this pair: the head's cache starts again
    assert len(drafter.propose(1, tokens, 15, 2)) == 2 and offset() == 1
    drafter.forget(set())
    assert drafter.propose(1, tokens, 15, 2) == []


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_rows_drafting_together_get_what_each_would_alone(family):
    """``propose_rows`` (one head forward per depth) against ``propose`` row by row: the
    same drafts and the same head caches, with rows of different cache lengths, pair
    counts and depths, one skipping a step (a gap) and one with no room."""
    from mlxd.config import SpeculativeSettings
    from mlxd.engine.chat.speculative.mtp import MtpDrafter
    from mlxd.engine.chat.speculative.mtp_loading import attach_mtp

    head = attach_mtp(_loaded(tiny_mtp_dir(family)), SpeculativeSettings(mode="mtp")).draft
    alone, together = MtpDrafter(head), MtpDrafter(head)
    size = head.module.eh_proj.weight.shape[0]
    uids = [1, 2, 3]
    tokens = {uid: [3, 4, 5 + uid] for uid in uids}
    pending = {uid: 7 for uid in uids}
    drafts: dict[int, list[int]] = {uid: [] for uid in uids}
    rounds = [  # per round: the rows that verify with what they took, and each row's depth
        ({1: 0, 2: 0, 3: 0}, {1: 3, 2: 3, 3: 3}),
        ({1: 2, 2: 0}, {1: 3, 2: 2, 3: 3}),  # 3 skips a step: its head cache starts again
        ({1: 1, 2: 2, 3: 0}, {1: 3, 2: 0, 3: 1}),  # 2 has no room
        ({1: 3, 3: 1}, {1: 2, 3: 3}),
    ]
    mx.random.seed(0)
    for took, depth in rounds:
        verified = [u for u in uids if u in took]
        width = 1 + max(len(drafts[u]) for u in verified)
        hidden = mx.random.normal((len(verified), width, size))
        new = {u: 20 + 3 * u + len(tokens[u]) for u in verified}
        for u in verified:
            tokens[u].append(pending[u])
            tokens[u].extend(drafts[u][: took[u]])
            pending[u] = new[u]
        batch = SimpleNamespace(
            uids=verified,
            tokens=[tokens[u] for u in verified],
            _next_tokens=mx.array([new[u] for u in verified]),
        )
        accepted = [min(took[u], len(drafts[u])) for u in verified]
        for drafter in (alone, together):
            drafter._hidden = hidden
            drafter.observe(batch, verified, [drafts[u] for u in verified], accepted)  # type: ignore[arg-type]
        asks = [(u, tokens[u], pending[u], depth[u]) for u in uids if u in depth]
        each = [alone.propose(*ask) for ask in asks]
        assert together.propose_rows(asks) == each
        assert [len(d) for d in each] == [a[3] if a[0] in verified else 0 for a in asks]
        drafts = {u: [] for u in uids} | {a[0]: d for a, d in zip(asks, each, strict=True)}
    for u in uids:
        a, b = alone._rows[u].cache[0], together._rows[u].cache[0]
        assert a.offset == b.offset > 0
        assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-5)
        assert mx.allclose(a.values[..., : a.offset, :], b.values[..., : b.offset, :], atol=1e-5)


def test_the_head_is_fed_the_prompt_during_prefill_and_drafts_at_the_first_step():
    """Two prompts prefilled together in chunks of 4 (right-padded, then the rows' first
    step): each row's head cache holds the pairs of its whole prompt, as the head fed
    the full prompt's hidden states at once would, and the first decode step drafts."""
    from mlx_lm.generate import BatchGenerator

    from mlxd.config import SpeculativeSettings
    from mlxd.engine.chat.speculative.mtp_loading import attach_mtp
    from mlxd.engine.chat.speculative.speculator import Speculator

    loaded = attach_mtp(_loaded(tiny_mtp_dir("deepseek_v3")), SpeculativeSettings(mode="mtp"))
    head = loaded.draft
    tokenizer = tokenizer_of(tiny_mtp_dir("deepseek_v3"))
    # 22 and 24 tokens: six chunks each, the last right-padded; both move on together.
    prompts = [tokenizer.encode(TEXTS[1]), (tokenizer.encode(TEXTS[2]) * 3)[:24]]
    assert [len(p) for p in prompts] == [22, 24]
    gen = BatchGenerator(loaded.model, prefill_batch_size=2, prefill_step_size=4)
    speculator = Speculator(SpeculativeSettings(mode="mtp", max_draft_tokens=3, **WIDE), head)
    speculator.install(gen)
    uids = gen.insert(prompts, max_tokens=[8, 8])
    with full_depth(True):
        while not len(gen._generation_batch):
            gen.next()
        rows = speculator._mtp._rows
        for uid, prompt in zip(uids, prompts, strict=True):
            row = rows[uid]
            assert row.start == len(prompt) and len(row.hiddens) == 1 and not row.tokens
            hidden = head.trunk(mx.array([prompt]), None)
            cache = head.make_cache()
            head.module(head.embed(mx.array([prompt[1:]])), hidden[:, :-1], cache)
            fed = row.cache[0]
            assert fed.offset == cache[0].offset == len(prompt) - 1
            for a, b in ((fed.keys, cache[0].keys), (fed.values, cache[0].values)):
                assert mx.allclose(a[..., : fed.offset, :], b[..., : fed.offset, :], atol=1e-4)
            assert mx.allclose(row.hiddens[0], hidden[0, -1], atol=1e-4)
        gen.next()
    assert speculator.take().drafted == 6  # both rows drafted at their first step
