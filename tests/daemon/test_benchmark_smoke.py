"""The benchmarks' quick modes run end to end on tiny models (serving.py, agent_session.py, ...).

This checks that the script works (mlxd, the batch_generate ceiling and
mlx_lm.server are started, driven and reported), not how fast anything is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

SYSTEMS = ("mlxd", "ceiling", "mlx_lm_server")
POSITIVE = (
    "e2e_tps",
    "decode_tps",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "itl_p50_ms",
    "itl_p95_ms",
    "wall_s",
)


def run_script(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a benchmark script; on ``timeout`` end it *and the servers it started*.

    ``subprocess.run(timeout=)`` kills only the script: its mlxd and
    mlx_lm.server children lived on, serving nothing and loading the machine
    for the rest of the suite (two were found running 12 minutes after a
    loaded run timed the quick benchmark out). The script runs in its own
    session so that its whole process group goes.
    """
    with subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_quick_benchmark_writes_json_and_table(tiny_models, tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--quick",
        "--model", str(tiny_models("llama")), "--mlx-lm-server",
        "--stats-interval", "0.02", "--out", str(out),
    ]  # fmt: skip
    done = run_script(cmd, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]

    report = json.loads(out.read_text())
    assert report["settings"]["concurrency"] == [1, 4]
    assert report["settings"]["max_tokens"] == 16
    env = report["environment"]
    for key in (
        "model_path",
        "model_dtype",
        "mlx",
        "mlx_lm",
        "cpu_count",
        "mlxd_runtime",
        "ceiling_runtime",
    ):
        assert env[key], key
    assert "blas" in env["mlxd_runtime"] and "blas" in env["ceiling_runtime"]

    assert set(report["results"]) == set(SYSTEMS)
    for system in SYSTEMS:
        for c in (1, 4):
            entry = report["results"][system][str(c)]
            m = entry["median"]
            assert m["errors"] == 0, (system, c, entry)
            assert m["streams"] == c
            assert 0 < m["tokens"] <= 16 * c, (system, c, m)
            for key in POSITIVE:
                assert m[key] > 0, (system, c, key, m)
            assert len(entry["texts"]) == c
    ceiling = report["results"]["ceiling"]["4"]["median"]
    assert ceiling["peak_kv_bytes"] > 0
    mlxd_kv = report["results"]["mlxd"]["4"]["median"]["peak_kv_bytes"]
    assert mlxd_kv is None or mlxd_kv > 0  # None: no /stats poll landed inside the wave

    table = done.stdout
    assert "| C | mlxd tok/s | ceiling tok/s | mlxd/ceiling |" in table
    assert "\n| 4 | " in table


def test_prompt_concurrency_sweep_runs_each_value(tiny_models, tmp_path: Path) -> None:
    out = tmp_path / "pc.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "prompt_concurrency.py"), "--quick",
        "--values", "1,4", "--repeats", "1", "--model", str(tiny_models("llama")),
        "--stats-interval", "0.02", "--out", str(out),
    ]  # fmt: skip
    done = run_script(cmd, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["values"] == [1, 4] and report["concurrency"] == [1, 4]
    for p in ("1", "4"):
        for c in ("1", "4"):
            (run,) = report["runs"][p][c]
            assert run["errors"] == 0 and run["streams"] == int(c)
            assert run["e2e_tps"] > 0 and run["ttft_p50_ms"] > 0, (p, c, run)
    assert "\n| 4 | 4 | " in done.stdout and "\n| 1 | 1 | " in done.stdout


def test_structured_benchmark_runs_on_a_tiny_model(tiny_models, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "structured.py"),
        "--model", str(tiny_models("llama")), "--waves", "1", "--max-tokens", "16",
        "--concurrency", "4", "--out", str(out),
    ]  # fmt: skip
    done = run_script(cmd, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    waves = report["throughput"]["waves"]
    assert [w["constrained"] for w in waves] == [False, True]
    assert all(w["tokens"] == 4 * 16 and w["tps"] > 0 for w in waves)
    comp = report["compile"]
    assert comp["schemas"] >= 10 and 0 < comp["cached_p50_ms"] < comp["cold_p50_ms"]
    assert "| 4 | 16 |" in done.stdout


def test_fleet_benchmark_runs_on_two_tiny_models(tiny_models) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "fleet.py"),
        "--a", str(tiny_models("llama")), "--b", str(tiny_models("llama_b")),
        "--tokens", "8", "--concurrency", "2", "--cycles", "2",
    ]  # fmt: skip
    done = run_script(cmd, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| cold TTFT (load + prefill), s |" in done.stdout
    assert "2 streams to each model at once:" in done.stdout
    assert "(2 evictions in 2 requests)" in done.stdout


def test_agent_session_benchmark_replays_a_session_on_both_servers(tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "agent_session.py"), "--quick",
        "--turns", "2", "--system-chars", "400", "--result-chars", "200", "--tools", "1",
        "--out", str(out),
    ]  # fmt: skip
    done = run_script(cmd, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["family"] == "KVCache" and report["settings"]["turns"] == 2
    assert report["settings"]["tools"] == 1
    mlxd, peer, restart = result["mlxd"], result["mlx_lm_server"], result["mlxd_restart"]
    assert [r["turn"] for r in mlxd] == [r["turn"] for r in peer] == ["1", "2", "new"]
    # Both servers saw the same prompts; turn 2 reuses at least turn 1's whole prompt.
    assert [r["prompt"] for r in mlxd] == [r["prompt"] for r in peer]
    assert mlxd[1]["prompt"] > mlxd[0]["prompt"] > 0
    assert mlxd[0]["cached"] == 0 and mlxd[1]["cached"] >= mlxd[0]["prompt"]
    assert all(r["ttft_ms"] > 0 for r in mlxd + peer)
    assert mlxd[1]["header"].startswith(f"cached={mlxd[1]['cached']}; prompt=")
    # After the restart the session resumes at turn 2.
    assert restart[0]["prompt"] is None and restart[1]["prompt"] == mlxd[1]["prompt"]
    assert set(result["verdict"]) >= {"mlxd_worst_ttft_ratio", "restart_turn2_share"}
    assert "| turn | prompt | mlxd cached | mlxd TTFT ms | mlx_lm.server cached |" in done.stdout
    assert "\n| 2 | " in done.stdout


def test_priority_benchmark_measures_fifo_against_preemption(tiny_models, tmp_path: Path) -> None:
    out = tmp_path / "priority.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "priority.py"), "--quick",
        "--model", str(tiny_models("llama")), "--modes", "fifo,preempt", "--out", str(out),
        "--seconds", "2",  # a window that sees a few interactive requests: it runs, that is all
    ]  # fmt: skip
    done = run_script(cmd, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"fifo", "preempt"}
    for m in results.values():
        assert m["errors"] == 0 and m["tokens_per_s"] > 0 and m["interactive_requests"] > 0
    assert results["fifo"]["preemptions"] == 0
    assert "| preempt |" in done.stdout and "vs fifo" in done.stdout


def test_speculative_benchmark_compares_modes_in_one_daemon(tiny_models, tmp_path: Path) -> None:
    out = tmp_path / "speculative.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "speculative.py"), "--quick",
        "--model", str(tiny_models("llama")), "--tasks", "copy", "--out", str(out),
    ]  # fmt: skip
    done = run_script(cmd, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mode"], r["c"]) for r in rows} == {("off", 2), ("prompt_lookup", 2)}
    assert all(r["tokens"] > 0 and r["tps"] > 0 for r in rows)
    assert all(r["spec_verify_steps"] == 0 for r in rows if r["mode"] == "off")
    assert "| copy | 2 |" in done.stdout and "prompt_lookup vs off" in done.stdout
    assert all(isinstance(r["depths"], dict) for r in rows) and "per step" in done.stdout
