"""The fast CPU path on Linux, on the real demo model: OpenBLAS is exact, the
daemon reports what it actually loaded, and the no-BLAS path still serves."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlxd.runtime.blas import find_system_blas
from tests.support.daemon import Daemon, toml_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.system() != "Linux", reason="BLAS selection is Linux-only"),
]

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def need_openblas():
    if find_system_blas() is None:
        message = "no system OpenBLAS (Debian: apt-get install libopenblas0-pthread)"
        if os.environ.get("MLXD_REQUIRE_OPENBLAS") == "1":
            pytest.fail(message)
        pytest.skip(message)


GREEDY = textwrap.dedent(
    """
    import json, sys
    from mlxd.runtime.blas import ensure_blas, mapped_blas
    ensure_blas(sys.argv[1], None, sys.argv)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlxd.demo import prepare_demo_model
    model, tok = load(str(prepare_demo_model("float32")))
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    # The whole reply, as a server sends it: up to its EOS (40 tokens at most).
    out = []
    for t, _ in generate_step(mx.array(ids), model, max_tokens=40):
        out.append(t)
        if t in tok.eos_token_ids:
            break
    eos = out[-1] in tok.eos_token_ids
    print(json.dumps({"blas": mapped_blas().name, "tokens": out, "eos": eos}))
    """
)


def greedy_tokens(blas: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", GREEDY, blas], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_openblas_f32_is_token_exact_with_the_reference_blas():
    need_openblas()
    fast, reference = greedy_tokens("auto"), greedy_tokens("off")
    assert fast["blas"] == "openblas"
    assert reference["blas"] == "reference"
    assert fast["eos"] and len(fast["tokens"]) > 4  # a whole reply, not a cut-off one
    assert fast["tokens"] == reference["tokens"]


@pytest.fixture(scope="module")
def fast_daemon(daemons):
    need_openblas()
    return daemons.get(toml_config(batch={"size": 2}))


def test_auto_runs_float32_on_openblas_and_reports_the_mapped_library(fast_daemon):
    stats = fast_daemon.stats()
    runtime = stats["runtime"]
    assert runtime["blas"] == "openblas" and runtime["blas_optimized"] is True
    assert "openblas" in runtime["blas_path"]
    assert runtime["pid"] == fast_daemon.proc.pid  # re-executed in place: same PID
    assert runtime["device"].startswith("cpu")
    assert "float32" in stats["model"]["path"]
    # read from the process's mapped libraries, not from the setting
    maps = Path(f"/proc/{fast_daemon.proc.pid}/maps").read_text()
    assert runtime["blas_path"] in maps
    log = fast_daemon.log()
    assert log.count("re-executing with LD_PRELOAD") == 1


def test_batched_greedy_demo_output_matches_mlx_lm_generate(fast_daemon):
    from mlx_lm import generate, load

    path = fast_daemon.stats()["model"]["path"]
    model, tokenizer = load(path)
    prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True)
    expected = generate(model, tokenizer, prompt, max_tokens=24)
    client = fast_daemon.openai()
    reply = client.chat.completions.create(
        model=fast_daemon.model_id(), messages=FRANCE, temperature=0, max_tokens=24
    )
    assert reply.choices[0].message.content == expected
    assert "Paris" in expected


def test_without_an_optimized_blas_the_demo_runs_4bit_and_serves(tmp_path):
    d = Daemon(tmp_path, toml_config(runtime={"blas": "off"}, batch={"size": 2})).start(timeout=900)
    try:
        stats = d.stats()
        assert (
            stats["runtime"]["blas"] == "reference" and stats["runtime"]["blas_optimized"] is False
        )
        assert "q4" in stats["model"]["path"]
        reply = d.openai().chat.completions.create(
            model=d.model_id(), messages=FRANCE, temperature=0, max_tokens=12
        )
        assert "Paris" in reply.choices[0].message.content
        assert "re-executing" not in d.log()
    finally:
        d.stop()
