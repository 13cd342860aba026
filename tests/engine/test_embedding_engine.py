"""EmbeddingEngine on the tiny random-weight BERT: vectors, batching, checks, lifecycle."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxd.config import Settings, load_settings
from mlxd.config.registry import for_model
from mlxd.engine.embeddings.checks import check_text_size
from mlxd.engine.embeddings.engine import EmbeddingEngine
from mlxd.engine.embeddings.jobs import Job, plan_passes
from mlxd.engine.embeddings.messages import EmbeddingError, EmbeddingInfo, EmbeddingResult
from mlxd.engine.messages import Failed
from tests.support.tinyembed import EMBED_CONFIG, QWEN3_CONFIG

TEXTS = [
    "hello river world",
    "The boats rock gently at their ropes, the fishermen mend their nets.",
    "a",
    "Numbers such as 1, 2, 3, 10, 42, 100 and 2048 appear in logs, tables and reports.",
    "Why is the sky blue?",
]


def settings_for(path: Path, *, batch: int = 8, **model: object) -> Settings:
    """The settings of ``[models.emb]`` (``kind = "embedding"``, its own ``batch.size``).

    The registry needs a chat model too; it is never loaded here.
    """
    entry = {"path": str(path), "kind": "embedding", "batch": {"size": batch}, **model}
    settings = load_settings(
        None, overrides={"models": {"chat": {"path": str(path)}, "emb": entry}}
    )
    return for_model(settings, "emb")


def make(
    path: Path, *, batch: int = 8, start: bool = True, at_start: bool = True, **model: object
) -> EmbeddingEngine:
    """An engine for ``[models.emb]`` that loads its model when it starts (``at_start``)."""
    engine = EmbeddingEngine(
        settings_for(path, batch=batch, **model), "emb", load_at_start=at_start
    )
    if start:
        engine.start()
        assert engine.wait_loaded(120), engine.load_error
    return engine


@pytest.fixture(scope="module")
def engine(tiny_embedding_model):
    engine = make(tiny_embedding_model)
    yield engine
    engine.stop()


def embed(engine: EmbeddingEngine, inputs, dimensions=None) -> EmbeddingResult:
    result = engine.submit(inputs, dimensions=dimensions).result(60)
    assert isinstance(result, EmbeddingResult), result
    return result


def refusal(engine: EmbeddingEngine, inputs, dimensions=None) -> Failed:
    # Refusals cross back as values, never as exceptions.
    failed = engine.submit(inputs, dimensions=dimensions).result(60)
    assert isinstance(failed, Failed), failed
    return failed


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def weights_bytes(path: Path) -> int:
    return sum(a.nbytes for a in mx.load(str(path / "model.safetensors")).values())


def test_info_describes_the_model(engine, tiny_embedding_model):
    info = engine.info
    assert info is not None and engine.alive
    assert info.id == "emb"
    assert info.family == "bert"
    assert info.dimensions == EMBED_CONFIG["hidden_size"]
    assert info.context_length == EMBED_CONFIG["max_position_embeddings"]
    assert info.vocab_size == len(hf_tokenizer(tiny_embedding_model))
    assert info.supports_dimensions
    assert info.dtype == "float32"
    assert engine.weights_bytes == info.weights_bytes == weights_bytes(tiny_embedding_model)


def test_vectors_have_the_hidden_size_and_unit_length(engine):
    result = embed(engine, TEXTS)
    assert result.vectors.shape == (len(TEXTS), EMBED_CONFIG["hidden_size"])
    assert result.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)


def test_prompt_tokens_count_every_input_with_its_special_tokens(engine, tiny_embedding_model):
    tok = hf_tokenizer(tiny_embedding_model)
    expected = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert embed(engine, TEXTS).prompt_tokens == expected


def test_a_batch_of_inputs_equals_each_input_alone(engine):
    together = embed(engine, TEXTS).vectors
    for i, text in enumerate(TEXTS):
        alone = embed(engine, [text]).vectors[0]
        assert float(np.dot(together[i], alone)) > 0.9999, (i, text)


def test_identical_texts_have_cosine_one_and_different_texts_differ(engine):
    v = embed(engine, [TEXTS[1], TEXTS[0], TEXTS[1]]).vectors
    assert float(np.dot(v[0], v[2])) == pytest.approx(1.0, abs=1e-6)
    assert float(np.dot(v[0], v[1])) < 0.99
    again = embed(engine, [TEXTS[1]]).vectors[0]
    assert float(np.dot(v[0], again)) == pytest.approx(1.0, abs=1e-6)


def test_token_ids_give_the_same_vector_as_their_text(engine, tiny_embedding_model):
    tok = hf_tokenizer(tiny_embedding_model)
    ids = [tok(t)["input_ids"] for t in TEXTS[:3]]
    from_ids = embed(engine, ids)
    from_text = embed(engine, TEXTS[:3])
    assert from_ids.prompt_tokens == from_text.prompt_tokens == sum(map(len, ids))
    for a, b in zip(from_ids.vectors, from_text.vectors, strict=True):
        assert float(np.dot(a, b)) > 0.9999


def test_dimensions_truncate_then_renormalize(engine):
    full = embed(engine, TEXTS).vectors
    short = embed(engine, TEXTS, dimensions=16).vectors
    assert short.shape == (len(TEXTS), 16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    same = embed(engine, TEXTS[:1], dimensions=EMBED_CONFIG["hidden_size"]).vectors
    np.testing.assert_allclose(same[0], full[0], atol=1e-6)


@pytest.mark.parametrize(
    ("inputs", "code", "needle"),
    [
        ([], "invalid_value", "must not be empty"),
        (["fine", ""], "invalid_value", "Input 1 is empty"),
        ([[]], "invalid_value", "Input 0 is empty"),
        (["text", [1, 2]], "invalid_value", "not a mix"),
        ([[2, 5, 3], [2, 400, 3]], "invalid_value", "outside this model's vocabulary of 400"),
        ([[2, -1, 3]], "invalid_value", "[-1]"),
        ([[1, True]], "invalid_value", "integer token ids"),
        ([[2] * 129], "context_length_exceeded", "Input 0 is 129 tokens"),
        (["ok", "x " * 2_000_000], "context_length_exceeded", "Input 1 is 2000000 words"),
        # Fewer words than the context, more tokens: found by tokenizing.
        (["ok", "ok", "word " * 100], "context_length_exceeded", "Input 2 is 202 tokens"),
    ],
)
def test_bad_inputs_are_refused_with_a_400(engine, inputs, code, needle):
    error = refusal(engine, inputs)
    assert (error.status, error.code, error.param) == (400, code, "input")
    assert needle in error.message
    assert embed(engine, ["still serving"]).vectors.shape[0] == 1


def test_long_unknown_words_are_one_token_each_and_fit(engine, tiny_embedding_model):
    # WordPiece turns a word longer than 100 characters into one [UNK]: 15,000 characters,
    # 102 tokens, within the context. No character bound may refuse it.
    text = " ".join(["q" * 150] * 100)
    assert engine.info is not None and engine.info.max_token_chars == 0
    assert engine.info.min_token_per_word
    result = embed(engine, [text, "x" * 1_000_000])
    assert result.prompt_tokens == 102 + 3
    assert result.prompt_tokens == sum(
        len(hf_tokenizer(tiny_embedding_model)(t)["input_ids"]) for t in [text, "x" * 1_000_000]
    )


@pytest.mark.parametrize("dimensions", [0, -3, EMBED_CONFIG["hidden_size"] + 1])
def test_dimensions_out_of_range_are_refused(engine, dimensions):
    error = refusal(engine, ["x"], dimensions)
    assert (error.status, error.code, error.param) == (400, "invalid_value", "dimensions")


def test_a_model_without_matryoshka_training_refuses_dimensions(tiny_embedding_model, tmp_path):
    plain = tmp_path / "plain-bert"
    shutil.copytree(tiny_embedding_model, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["matryoshka_dimensions"]
    (plain / "config.json").write_text(json.dumps(config))
    engine = make(plain)
    try:
        assert engine.info is not None and not engine.info.supports_dimensions
        error = refusal(engine, ["x"], 16)
        assert (error.status, error.code, error.param) == (
            400,
            "unsupported_parameter",
            "dimensions",
        )
        assert embed(engine, ["x"]).vectors.shape == (1, EMBED_CONFIG["hidden_size"])
    finally:
        engine.stop()


def test_max_context_lowers_the_limit_per_input(tiny_embedding_model):
    engine = make(tiny_embedding_model, max_context=8)
    try:
        assert engine.info is not None and engine.info.context_length == 8
        assert refusal(engine, ["the river runs past the old mill"]).code == (
            "context_length_exceeded"
        )
        assert embed(engine, ["river"]).vectors.shape[0] == 1
    finally:
        engine.stop()


def test_requests_queued_together_share_forward_passes(tiny_embedding_model):
    # Queued before the thread starts, so the first round sees them all at once.
    engine = make(tiny_embedding_model, batch=8, start=False)
    futures = [engine.submit(TEXTS[:3], dimensions=None) for _ in range(5)]
    engine.start()
    try:
        results = [f.result(60) for f in futures]
        snap = engine.snapshot()
        # Two requests (6 inputs) per round under a batch of 8; the fifth alone.
        assert snap.forward_passes == 3
        assert snap.last_batch_size == 3
        assert snap.requests_served == 5 and snap.inputs_embedded == 15
        for r in results[1:]:
            np.testing.assert_allclose(r.vectors, results[0].vectors, atol=1e-5)
    finally:
        engine.stop()


def test_a_forward_pass_holds_at_most_the_batch_size(tiny_embedding_model):
    engine = make(tiny_embedding_model, batch=2)
    try:
        result = embed(engine, TEXTS)
        snap = engine.snapshot()
        assert snap.forward_passes == 3  # 5 inputs, 2 per pass
        assert snap.batch_limit == 2 and snap.last_batch_size <= 2
        assert result.vectors.shape[0] == len(TEXTS)
    finally:
        engine.stop()


def test_snapshot_counts_work_and_state(tiny_embedding_model):
    engine = make(tiny_embedding_model, start=False)
    assert engine.snapshot().state == "loading" and not engine.alive
    engine.start()
    assert engine.wait_loaded(120)
    try:
        before = engine.snapshot()
        assert before.state == "ready" and before.weights_bytes == engine.weights_bytes > 0
        result = embed(engine, TEXTS[:2])
        refusal(engine, [""])
        after = engine.snapshot()
        assert after.requests_served == before.requests_served + 1
        assert after.requests_failed == before.requests_failed + 1
        assert after.inputs_embedded == before.inputs_embedded + 2
        assert after.tokens_embedded == before.tokens_embedded + result.prompt_tokens
        assert (after.queued, after.running) == (0, 0) and not engine.busy
    finally:
        engine.stop()
    assert engine.snapshot().state == "stopped" and not engine.alive


def test_the_thread_loads_unloads_and_applies_by_command(tiny_embedding_model, tmp_path):
    # The ModelEngine protocol: one thread for the life of the entry; the model comes and goes.
    engine = make(tiny_embedding_model, start=False, at_start=False)
    assert engine.snapshot().state == "unloaded" and not engine.alive
    engine.start()
    try:
        assert engine.alive and engine.info is None
        assert engine.wait_loaded(10) is False and engine.load_error is None
        assert refusal(engine, ["x"]).code == "model_not_loaded"
        settings = settings_for(tiny_embedding_model)
        info = engine.load(settings).result(120)
        assert info.id == "emb" and engine.info == info
        assert engine.snapshot().state == "ready" and engine.snapshot().weights_bytes > 0
        assert embed(engine, TEXTS[:2]).vectors.shape == (2, EMBED_CONFIG["hidden_size"])
        engine.apply(settings_for(tiny_embedding_model, batch=2)).result(10)
        assert engine.snapshot().batch_limit == 2
        assert engine.unload().result(60) is None
        after = engine.snapshot()
        assert engine.alive and engine.info is None and not engine.busy
        assert (after.state, after.weights_bytes, after.requests_served) == ("unloaded", 0, 1)
        assert refusal(engine, ["x"]).code == "model_not_loaded"
        # A request that comes while a load is under way waits for it.
        loading = engine.load(settings)
        waited = engine.submit(TEXTS[:3])
        info = loading.result(120)
        assert info.dimensions == EMBED_CONFIG["hidden_size"] and engine.info == info
        assert waited.result(60).vectors.shape[0] == 3
        assert engine.snapshot().requests_served == 1  # counted since the load
        # A failed load keeps the loaded model serving.
        from mlxd.engine.chat.loading import ModelLoadError

        with pytest.raises(ModelLoadError, match="is not a directory"):
            engine.load(settings_for(tmp_path / "missing")).result(60)
        assert engine.snapshot().state == "ready" and engine.info == info
        assert embed(engine, ["still here"]).vectors.shape[0] == 1
        engine.rename("emb2")
        assert engine.model_id == "emb2" and engine.snapshot().id == "emb2"
    finally:
        engine.stop()
    assert engine.snapshot().state == "stopped" and not engine.alive
    with pytest.raises(RuntimeError, match="stopped"):
        engine.load(settings).result(1)


def test_stop_fails_queued_requests_and_later_submits(tiny_embedding_model):
    engine = make(tiny_embedding_model, start=False)
    queued = engine.submit(["waiting"])
    assert engine.busy
    engine.stop()
    failed = queued.result(10)
    assert isinstance(failed, Failed)
    assert (failed.status, failed.code) == (503, "shutting_down")
    late = refusal(engine, ["late"])
    assert (late.status, late.code) == (503, "shutting_down")


def test_a_missing_path_is_a_load_error_not_a_download(tmp_path):
    engine = make(tmp_path / "no-such-model", start=False)
    queued = engine.submit(["x"])
    engine.start()
    assert not engine.wait_loaded(60)
    assert engine.load_error is not None and "is not a directory" in engine.load_error
    assert engine.snapshot().state == "failed"
    failed = queued.result(10)
    assert isinstance(failed, Failed)
    assert (failed.status, failed.code) == (503, "model_load_failed")
    assert "is not a directory" in failed.message
    assert refusal(engine, ["x"]).code == "model_load_failed"
    engine.stop()


def test_an_unsupported_family_is_a_load_error(tiny_embedding_model, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(tiny_embedding_model, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neo"}))
    engine = make(odd, start=False)
    engine.start()
    assert not engine.wait_loaded(60)
    assert "does not support model_type 'gpt_neo'" in (engine.load_error or "")
    engine.stop()


def test_without_the_extra_the_load_fails_naming_the_install(tiny_embedding_model, monkeypatch):
    # The one thing that cannot exist here for real: an install without mlx-embeddings.
    for name in [m for m in sys.modules if m.split(".")[0] == "mlx_embeddings"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlx_embeddings", None)
    engine = make(tiny_embedding_model, start=False)
    engine.start()
    assert not engine.wait_loaded(60)
    assert "pip install 'mlxd[embeddings]'" in (engine.load_error or "")
    # Issue 33 item 7: the command names this environment's Python, and the Make target.
    assert f"{sys.executable} -m pip install" in (engine.load_error or "")
    assert "make embeddings" in (engine.load_error or "")
    assert refusal(engine, ["x"]).status == 503
    engine.stop()


def info_with(**bounds) -> EmbeddingInfo:
    base = {"id": "m", "path": "/m", "family": "bert", "dimensions": 8, "context_length": 10}
    extra = {"vocab_size": 100, "weights_bytes": 0, "supports_dimensions": False, "dtype": "f"}
    return EmbeddingInfo(**base, **extra, **bounds)


@pytest.mark.parametrize(
    ("text", "bounds", "refused"),
    [
        # Characters: at most 10 tokens x 3 characters, whitespace not counted.
        ("a" * 30, {"max_token_chars": 3}, None),
        ("a" * 31, {"max_token_chars": 3}, "31 characters"),
        ("a b " * 15, {"max_token_chars": 3}, None),
        ("ab " * 11, {"max_token_chars": 3}, None),
        ("abcd " * 8, {"max_token_chars": 3}, "32 characters"),
        # Words: at least one token each.
        ("w " * 10, {"min_token_per_word": True}, None),
        ("w " * 11, {"min_token_per_word": True}, "11 words"),
        ("w" * 5000, {"min_token_per_word": True}, None),
        # No bound known: everything goes to the tokenizer.
        ("w " * 5000, {}, None),
    ],
)
def test_text_size_bounds_refuse_only_what_certainly_cannot_fit(text, bounds, refused):
    info = info_with(**bounds)
    if refused is None:
        check_text_size(0, text, info)
        return
    with pytest.raises(EmbeddingError) as caught:
        check_text_size(0, text, info)
    assert caught.value.code == "context_length_exceeded" and refused in caught.value.message


def test_a_big_text_being_tokenized_does_not_hold_back_a_small_request(engine):
    # 126 words of 32,000 characters: within the context (each is one [UNK]), about 4 MB to
    # normalize and tokenize, which takes a while; the small request behind it must not wait.
    big = engine.submit([" ".join(["q" * 32_000] * 126)])
    small = engine.submit(["a small one"])
    assert small.result(60).vectors.shape == (1, EMBED_CONFIG["hidden_size"])
    assert not big.done()
    assert big.result(120).prompt_tokens == 128


def test_a_tokenizer_json_that_truncates_is_never_used_to_cut_inputs(
    tiny_embedding_model, tmp_path
):
    cutting = tmp_path / "cutting"
    shutil.copytree(tiny_embedding_model, cutting)
    tok = json.loads((cutting / "tokenizer.json").read_text())
    tok["truncation"] = {
        "direction": "Right",
        "max_length": 8,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    tok["padding"] = {
        "strategy": {"Fixed": 32}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]",
    }  # fmt: skip
    (cutting / "tokenizer.json").write_text(json.dumps(tok))
    text = TEXTS[1]
    expected = len(hf_tokenizer(tiny_embedding_model)(text)["input_ids"])
    assert expected > 8
    engine = make(cutting, max_context=expected)
    try:
        assert embed(engine, [text]).prompt_tokens == expected
        assert refusal(engine, [text + " and more words"]).code == "context_length_exceeded"
    finally:
        engine.stop()


def job_of(lengths: list[int]) -> Job:
    from concurrent.futures import Future

    return Job(inputs=[[1] * n for n in lengths], dimensions=None, future=Future(),
               ids=[[1] * n for n in lengths])  # fmt: skip


def test_plan_passes_sorts_by_length_and_caps_inputs_and_padded_tokens():
    a, b = job_of([5, 1, 9]), job_of([3, 7])
    passes = plan_passes([a, b], limit=2, pass_tokens=100)
    lengths = [[len(j.ids[i]) for j, i in p] for p in passes]
    assert lengths == [[1, 3], [5, 7], [9]]
    # Several requests share a pass.
    assert [[j is a for j, _ in p] for p in passes] == [[True, False], [True, False], [True]]
    # Padded tokens: 3 x 40 > 100, so passes of two; one input longer than the cap runs alone.
    wide = plan_passes([job_of([40, 40, 40, 500])], limit=8, pass_tokens=100)
    assert [[len(j.ids[i]) for j, i in p] for p in wide] == [[40, 40], [40], [500]]
    every = [(id(j), i) for p in plan_passes([a, b], limit=8) for j, i in p]
    assert sorted(every) == sorted([(id(a), i) for i in range(3)] + [(id(b), i) for i in range(2)])


def test_a_process_that_used_an_engine_exits_cleanly(tiny_embedding_model):
    # MLX state made on the engine's thread must not outlive it: freeing it at interpreter
    # exit, after the thread's stream is gone, aborts the process ("terminate called ...").
    code = (
        "import sys\n"
        "import mlx_embeddings  # as a caller that uses it too: its modules load here\n"
        "from mlxd.config import load_settings\n"
        "from mlxd.config.registry import for_model\n"
        "from mlxd.engine.embeddings.engine import EmbeddingEngine\n"
        "p = sys.argv[1]\n"
        "models = {'chat': {'path': p}, 'emb': {'path': p, 'kind': 'embedding'}}\n"
        "s = for_model(load_settings(None, overrides={'models': models}), 'emb')\n"
        "e = EmbeddingEngine(s, 'emb', load_at_start=True); e.start()\n"
        "assert e.wait_loaded(120), e.load_error\n"
        "texts = ['hello river world', 'the boats rock', 'a', 'the river runs past the mill']\n"
        "print(e.submit(texts).result(60).vectors.shape)\n"
        "e.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_embedding_model)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "(4, 64)" in done.stdout


@pytest.fixture(scope="module")
def qwen3_engine():
    from tests.support.tinyembed import tiny_qwen3_embedding_dir

    engine = make(tiny_qwen3_embedding_dir())
    yield engine
    engine.stop()


def test_a_causal_last_token_model_batches_like_singles(qwen3_engine):
    # Qwen3-Embedding pools the last real token: right padding must not move it.
    info = qwen3_engine.info
    assert info is not None and info.family == "qwen3" and info.supports_dimensions
    assert info.dimensions == QWEN3_CONFIG["hidden_size"]
    assert info.context_length == QWEN3_CONFIG["max_position_embeddings"]
    assert info.max_token_chars > 0 and not info.min_token_per_word  # byte-level BPE
    together = embed(qwen3_engine, TEXTS).vectors
    for i, text in enumerate(TEXTS):
        alone = embed(qwen3_engine, [text]).vectors[0]
        assert float(np.dot(together[i], alone)) > 0.9999, (i, text)
    assert float(np.dot(together[0], together[1])) < 0.99
    short = embed(qwen3_engine, TEXTS, dimensions=8).vectors
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)


def test_a_byte_level_model_refuses_a_huge_text_by_its_characters(qwen3_engine):
    info = qwen3_engine.info
    assert info is not None
    limit = info.context_length * info.max_token_chars
    error = refusal(qwen3_engine, ["ok", "x" * (limit + 1)])
    assert error.code == "context_length_exceeded"
    assert f"Input 1 is {limit + 1} characters" in error.message


@pytest.mark.parametrize(
    "family", ["xlm_roberta", "modernbert", "modernbert_mlm", "gemma3_text", "qwen3"]
)
def test_every_family_batches_like_singles(family):
    # Padding must be invisible in each family's own way: RoBERTa's positions counted from
    # the padding id, ModernBERT's local attention windows, EmbeddingGemma's sliding
    # windows and dense head, Qwen3's causal last token.
    from tests.support.tinyembed import ENCODER_FAMILIES, tiny_encoder_dir, tiny_qwen3_embedding_dir

    path = tiny_qwen3_embedding_dir() if family == "qwen3" else tiny_encoder_dir(family)
    engine = make(path)
    try:
        info = engine.info
        assert info is not None and info.family == ("qwen3" if family == "qwen3" else (
            ENCODER_FAMILIES[family]["model_type"]))  # fmt: skip
        hidden = QWEN3_CONFIG["hidden_size"] if family == "qwen3" else 64
        together = embed(engine, TEXTS).vectors
        assert together.shape == (len(TEXTS), hidden)
        np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
        for i, text in enumerate(TEXTS):
            alone = embed(engine, [text]).vectors[0]
            assert float(np.dot(together[i], alone)) > 0.9999, (family, i, text)
        assert float(np.dot(together[0], together[1])) < 0.99
    finally:
        engine.stop()


def test_a_failing_pass_fails_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    # A forward pass that raises, or a bug after it, cannot be produced by a healthy model:
    # both are injected here. The requests get 500 and the thread keeps serving.
    import mlxd.engine.embeddings.engine as embedding
    import mlxd.engine.embeddings.loading as embedding_model

    def broken_pass(*_args, **_kw):
        raise RuntimeError("injected pass failure")

    monkeypatch.setattr(embedding_model, "run_pass", broken_pass)
    error = refusal(engine, TEXTS[:2])
    assert (error.status, error.code) == (500, "embedding_error")
    assert "injected pass failure" in error.message
    monkeypatch.undo()

    def broken_result(_job):
        raise RuntimeError("injected bug after the pass")

    monkeypatch.setattr(embedding, "result_of", broken_result)
    error = refusal(engine, TEXTS[:2])
    assert (error.status, error.code) == (500, "embedding_error")
    monkeypatch.undo()
    assert engine.alive and not engine.busy
    assert embed(engine, TEXTS[:2]).vectors.shape == (2, EMBED_CONFIG["hidden_size"])
