"""mlxd.runtime.blas: finding, preloading and reporting the CPU BLAS.

The re-exec tests start real interpreters: a child prints a ``RUN`` line each
time its main code starts, so a re-exec shows as a second line with the same PID.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from mlxd.runtime.blas import (
    REEXEC_GUARD,
    BlasError,
    ensure_blas,
    find_system_blas,
    install_hint,
)
from tests.support import ROOT

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="BLAS preloading only applies to Linux"
)

SYSTEM_BLAS = find_system_blas()
# Children print one JSON line per start of their main code.
PRELUDE = textwrap.dedent(
    """
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
    print("RUN " + json.dumps({
        "pid": os.getpid(), "guard": os.environ.get("MLXD_BLAS_REEXEC"),
        "argv": sys.argv[1:], "orig_argv": sys.orig_argv[1:],
        "comm": open("/proc/self/comm").read().strip(),
    }), flush=True)
    from mlxd.runtime.blas import ensure_blas, mapped_blas
    """
)
REPORT = textwrap.dedent(
    """
    info = mapped_blas()
    print("INFO " + json.dumps({**info.__dict__, "env": {
        k: os.environ.get(k) for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "MLXD_TEST_MARKER")
    }}), flush=True)
    """
)


def _needs_openblas() -> Path:
    if SYSTEM_BLAS is None:
        if os.environ.get("MLXD_REQUIRE_OPENBLAS") == "1":
            pytest.fail("MLXD_REQUIRE_OPENBLAS=1 but find_system_blas() found no OpenBLAS")
        pytest.skip("no system OpenBLAS (Debian: apt-get install libopenblas0-pthread)")
    return SYSTEM_BLAS


def _preload_target() -> Path:
    """A library that ensure_blas accepts: system OpenBLAS, else MLX's bundled BLAS."""
    if SYSTEM_BLAS is not None:
        return SYSTEM_BLAS
    import mlx

    for root in mlx.__path__:
        found = sorted(Path(root).parent.glob("mlx*.libs/libblas*.so*"))
        if found:
            return found[0]
    pytest.skip("neither a system OpenBLAS nor the mlx-cpu wheel's libblas is installed")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXEC_GUARD)}
    for key in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        env.pop(key, None)
    return {**env, **extra}


def _run(args: list[str], env: dict[str, str]) -> tuple[int, list[dict], dict | None, str]:
    proc = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    runs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("RUN ")]
    infos = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("INFO ")]
    return proc.returncode, runs, infos[-1] if infos else None, proc.stderr


def _libc_path() -> str:
    with open("/proc/self/maps") as maps:
        return next(line.split()[-1] for line in maps if "/libc.so" in line or "/libc-" in line)


def test_auto_reexecs_once_with_openblas() -> None:
    library = _needs_openblas()
    libc = _libc_path()  # an existing LD_PRELOAD entry, harmless to preload
    code = PRELUDE + "ensure_blas('auto', None, sys.argv)\nimport mlx.core\n" + REPORT
    code += "sys.exit(7)\n"
    args = ["--flag", "two words", "ünïcode", ""]
    env = _env(LD_PRELOAD=libc, MLXD_TEST_MARKER="kept ✓")
    rc, runs, info, stderr = _run([sys.executable, "-c", code, *args], env)

    assert rc == 7, stderr
    assert len(runs) == 2, f"expected one re-exec, got {len(runs)} runs\n{stderr}"
    first, second = runs
    assert first["pid"] == second["pid"]
    assert (first["guard"], second["guard"]) == (None, "1")
    assert first["argv"] == second["argv"] == args
    assert first["orig_argv"] == second["orig_argv"]
    assert info is not None, stderr
    assert info["name"] == "openblas" and info["optimized"] is True
    assert os.path.realpath(info["path"]) == os.path.realpath(library)
    assert info["env"]["LD_PRELOAD"] == f"{library}:{libc}"
    assert info["env"]["MLXD_TEST_MARKER"] == "kept ✓"
    expected_threads = len(os.sched_getaffinity(0))
    assert info["env"]["OPENBLAS_NUM_THREADS"] == str(expected_threads)
    assert info["threads"] == expected_threads


def test_user_thread_count_wins() -> None:
    _needs_openblas()
    code = PRELUDE + "ensure_blas('auto', 2, sys.argv)\n" + REPORT
    rc, runs, info, stderr = _run([sys.executable, "-c", code], _env(OPENBLAS_NUM_THREADS="1"))
    assert rc == 0 and len(runs) == 2, stderr
    assert info is not None and info["env"]["OPENBLAS_NUM_THREADS"] == "1"
    assert info["threads"] == 1


def test_off_keeps_the_wheels_blas() -> None:
    # numpy maps its own libscipy_openblas64_; it must not be mistaken for MLX's BLAS.
    code = PRELUDE + "ensure_blas('off', None, sys.argv)\nimport numpy, mlx.core\n" + REPORT
    rc, runs, info, stderr = _run([sys.executable, "-c", code], _env())
    assert rc == 0 and len(runs) == 1, stderr
    assert info is not None
    assert info["optimized"] is False, f"mlx now links an optimized BLAS: {info}"
    assert info["name"] == "reference" and info["threads"] == 1
    assert "mlx" in info["path"] and info["env"]["LD_PRELOAD"] is None


def test_no_reexec_once_mlx_is_imported() -> None:
    _needs_openblas()
    code = PRELUDE.replace("import json,", "import mlx.core, json,")
    code += "ensure_blas('auto', None, sys.argv)\n" + REPORT
    rc, runs, info, stderr = _run([sys.executable, "-c", code], _env())
    assert rc == 0 and len(runs) == 1, stderr
    assert "mlx is already imported" in stderr
    assert info is not None and info["name"] == "reference"


def test_one_warning_with_hint_when_nothing_is_found() -> None:
    code = PRELUDE + textwrap.dedent(
        """
        import mlxd.runtime.blas as blas
        blas.find_system_blas = lambda: None  # as on a machine without OpenBLAS
        ensure_blas("auto", None, sys.argv)
        """
    )
    rc, runs, _, stderr = _run([sys.executable, "-c", code], _env())
    assert rc == 0 and len(runs) == 1, stderr
    warnings = [line for line in stderr.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 1, stderr
    assert "no optimized BLAS found" in warnings[0]
    hint = install_hint()
    assert (hint or "libopenblas.so.0") in warnings[0]


def test_guard_without_preload_warns_and_stops() -> None:
    code = PRELUDE + "ensure_blas('auto', None, sys.argv)\n"
    rc, runs, _, stderr = _run([sys.executable, "-c", code], _env(**{REEXEC_GUARD: "1"}))
    assert rc == 0 and len(runs) == 1, stderr
    assert "did not provide cblas_sgemm" in stderr


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BlasError, match=r"no such file.*'auto', 'off'"):
        ensure_blas(str(tmp_path / "libopenblas.so.0"), None, sys.argv)
    not_blas = tmp_path / "libnotblas.so"
    not_blas.write_text("not an ELF file")
    with pytest.raises(BlasError, match="cblas_sgemm"):
        ensure_blas(str(not_blas), None, sys.argv)


def test_mapped_blas_reads_manual_preload() -> None:
    library = _needs_openblas()
    code = textwrap.dedent(
        """
        import json, os
        from mlxd.runtime.blas import mapped_blas
        info = mapped_blas()
        with open("/proc/self/maps") as f:
            fields = [line.split(maxsplit=5) for line in f]
        mapped = {x[5].strip() for x in fields if len(x) == 6}
        print(json.dumps({**info.__dict__, "mapped": info.path in mapped}))
        """
    )
    env = _env(LD_PRELOAD=str(library), OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    info = json.loads(out)
    assert info["name"] == "openblas" and info["optimized"] is True
    assert info["path"] == os.path.realpath(library) and info["mapped"] is True
    assert info["threads"] == 1


@pytest.mark.parametrize("style", ["-c", "-m", "script", "shebang"])
def test_reexec_preserves_command_line(style: str, tmp_path: Path) -> None:
    library = _preload_target()
    body = PRELUDE + f"ensure_blas({str(library)!r}, 1, sys.argv)\nsys.exit(5)\n"
    (tmp_path / "probe_pkg").mkdir()
    (tmp_path / "probe_pkg" / "__main__.py").write_text(body)
    script = tmp_path / "probe-script"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    launch = {
        "-c": [sys.executable, "-c", body],
        "-m": [sys.executable, "-u", "-m", "probe_pkg"],
        "script": [sys.executable, str(script)],
        "shebang": [str(script)],
    }[style]
    args = ["serve", "--config", "a b.toml", "-c", "-m"]
    rc, runs, _, stderr = _run([*launch, *args], _env(PYTHONPATH=str(tmp_path)))
    assert rc == 5, stderr
    assert len(runs) == 2, stderr
    assert runs[0]["pid"] == runs[1]["pid"]
    assert runs[0]["argv"] == runs[1]["argv"] == args
    assert runs[0]["orig_argv"] == runs[1]["orig_argv"]
    # A script started through its #! line keeps its process name (pgrep, killall).
    comm = "probe-script" if style == "shebang" else Path(sys.executable).name[:15]
    assert runs[0]["comm"] == runs[1]["comm"] == comm


def test_signals_reach_the_reexeced_process() -> None:
    library = _preload_target()
    code = PRELUDE + textwrap.dedent(
        f"""
        ensure_blas({str(library)!r}, 1, sys.argv)
        import signal
        def on_hup(*_):
            print("HUP", os.getpid(), flush=True)
        def on_term(*_):
            print("TERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGHUP, on_hup)
        signal.signal(signal.SIGTERM, on_term)
        print("READY", os.environ.get("MLXD_BLAS_REEXEC"), flush=True)
        while True:
            signal.pause()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()

    def next_line(prefix: str) -> str:
        while True:
            line = lines.get(timeout=20).strip()
            if line.startswith(prefix):
                return line

    try:
        assert next_line("READY") == "READY 1"
        proc.send_signal(signal.SIGHUP)
        assert next_line("HUP") == f"HUP {proc.pid}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert next_line("TERM") == "TERM"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("os_release", "expected"),
    [
        ("ID=debian\n", "sudo apt-get install libopenblas0-pthread"),
        ('ID=ubuntu\nID_LIKE="debian"\n', "sudo apt-get install libopenblas0-pthread"),
        ('ID=linuxmint\nID_LIKE="ubuntu debian"\n', "sudo apt-get install libopenblas0-pthread"),
        ('ID="fedora"\n', "sudo dnf install openblas-threads"),
        ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "sudo dnf install openblas-threads"),
        ("ID=arch\n", "sudo pacman -S openblas"),
        ("ID=manjaro\nID_LIKE=arch\n", "sudo pacman -S openblas"),
        (
            'ID="opensuse-tumbleweed"\nID_LIKE="opensuse suse"\n',
            "sudo zypper install libopenblas_pthreads0",
        ),
        ("ID=alpine\n", "apk add openblas"),
        ("# comment\nID=nixos\n", None),
        ("", None),
    ],
)
def test_install_hint(os_release: str, expected: str | None, tmp_path: Path) -> None:
    path = tmp_path / "os-release"
    path.write_text(os_release)
    assert install_hint(path) == expected


def test_install_hint_missing_file(tmp_path: Path) -> None:
    assert install_hint(tmp_path / "absent") is None
