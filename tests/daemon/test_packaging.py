"""``pip install .`` gives a working ``mlxd``: templates and static files ship in the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT
from tests.support.daemon import free_port


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("mlxd-*.whl")
    return path


def test_wheel_contains_templates_static_and_the_entry_point(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "mlxd/templates/dashboard.html",
        "mlxd/templates/partials/kv-gauge.html",
        "mlxd/static/htmx.min.js",
        "mlxd/static/mlxd.css",
        "mlxd/engine/chat/core.py",
    ):
        assert required in names, required
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mlxd = mlxd.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not any(n.startswith("tests/") for n in names)


def test_installed_wheel_serves_the_dashboard(wheel, tmp_path, tiny_models):
    # The installed wheel must be what runs: a PYTHONPATH at a checkout (how a worktree runs
    # its tests) would put that checkout's mlxd first.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, env=env
    )
    # Dependencies come from the test environment, appended after the new venv's own packages.
    site = subprocess.run(
        [str(py), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    Path(site.stdout.strip(), "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Run from elsewhere, so the checkout's mlxd/ is not on the path.
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import mlxd, mlxd.paths as p; print(mlxd.__file__); print(p.templates_dir())",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert where.returncode == 0, where.stderr
    module, templates = where.stdout.split()
    assert str(venv) in module and str(venv) in templates, (
        "the installed copy must be used, not the checkout"
    )
    check = subprocess.run(
        [str(venv / "bin" / "mlxd"), "check-config", str(ROOT / "config.example.toml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert check.returncode == 0 and "[batch]" in check.stdout
    port = free_port()
    log = open(tmp_path / "log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [
            str(venv / "bin" / "mlxd"),
            "serve",
            "--model",
            str(tiny_models("llama")),
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/dashboard", timeout=2)
                if page.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "log"
            ).read_text()
            time.sleep(0.2)
        assert 'id="kv-gauge"' in page.text
        htmx = httpx.get(f"http://127.0.0.1:{port}/static/htmx.min.js", timeout=5)
        assert htmx.status_code == 200 and len(htmx.content) > 10_000
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
