"""The config editor over HTTP against the real daemon, and its file operations.

The daemon is bound off loopback (``--host 0.0.0.0``, reached via 127.0.0.1)
with an admin token, so every request here shows its credentials: the admin
header, the CSRF cookie and its token. ``configfile`` (atomic writes, the
history, rollback, conflicts) is tested on its own in temporary directories.
"""

from __future__ import annotations

import html
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from mlxd.api.state import AppState
from mlxd.config import Settings, load_settings
from mlxd.dashboard import configfile
from mlxd.engine.chat.engine import Engine
from mlxd.engine.fleet.fleet import Fleet
from mlxd.web import make_app
from tests.support.daemon import Daemon, toml_config


def _engine(settings, model_id, pool, at_start):
    return Engine(settings, pool=pool, model_id=model_id, load_at_start=at_start)


ADMIN_TOKEN = "adm-editor-test-token"
API_KEY = "sk-editor-secret-key"
ADMIN = {"X-Mlxd-Admin-Token": ADMIN_TOKEN}
QUICK_DEFAULTS = {
    "batch.size": "2",
    "batch.kv_budget": "16MiB",
    "batch.prompt_concurrency": "8",
    "lanes.logprobs": "batch",
    "lanes.penalties": "batch",
    "lanes.logit_bias": "batch",
}


def _config(model_dir: Path) -> str:
    body = toml_config(
        server={"admin_token": ADMIN_TOKEN, "api_keys": [API_KEY]},
        model={"path": str(model_dir)},
        batch={"size": 2, "kv_budget": "16MiB"},
        sampling={"temperature": 0.0},
    )
    return "# written by hand, with a comment\n" + body


def _strays(workdir: Path) -> list[Path]:
    """What a write killed between creating its temp file and renaming it leaves behind."""
    return [workdir / ".mlxd.toml.k1ll3d.tmp", workdir / ".mlxd.toml.history" / ".x.tmp"]


def _leave_strays(workdir: Path) -> None:
    strays = _strays(workdir)
    strays[1].parent.mkdir()
    for stray in strays:
        stray.write_text("[batch]\nsi")
    (workdir / "notes.tmp").write_text("x")  # not ours: stays


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    # Its own: the editor rewrites its config file.
    d = daemons.get(
        _config(tiny_models("llama")),
        name="editor",
        args=["--host", "0.0.0.0"],
        prepare=_leave_strays,
    )
    d.strays = _strays(d.workdir)
    d.keep = d.workdir / "notes.tmp"
    return d


class Editor:
    """A browser-like client of the editor: admin header, CSRF cookie, the loaded hash."""

    def __init__(self, d: Daemon, headers: dict[str, str] | None = None):
        self.d = d
        self.client = httpx.Client(base_url=d.url, headers=ADMIN if headers is None else headers)
        self.sha256 = ""
        self.token = ""

    def load(self) -> str:
        page = self.client.get("/dashboard/config")
        assert page.status_code == 200, page.text
        self.sha256 = re.search(r'name="base_sha256" value="([0-9a-f]{64})"', page.text)[1]
        self.token = re.search(r'name="_csrf_token" value="([^"]+)"', page.text)[1]
        return page.text

    def post(self, action: str, **form: str) -> httpx.Response:
        data = {"base_sha256": self.sha256, **form}
        headers = {"X-CSRF-Token": self.token, "HX-Request": "true"}
        return self.client.post(f"/dashboard/config/{action}", data=data, headers=headers)

    def quick(self, action: str, **changes: str) -> httpx.Response:
        values = {k.replace("__", "."): v for k, v in changes.items()}
        return self.post(action, source="quick", **{**QUICK_DEFAULTS, **values})

    def raw(self, action: str, text: str) -> httpx.Response:
        return self.post(action, source="raw", text=text)


def _stats(d: Daemon) -> dict[str, Any]:
    return httpx.get(f"{d.url}/stats", headers=ADMIN, timeout=10).json()


def _state(d: Daemon) -> tuple[bytes, int, int, list[str]]:
    """What must not move when a submission is refused: file, version, batch size, history."""
    s = _stats(d)
    history = sorted(os.listdir(configfile.history_dir(d.config_path))) if _has_history(d) else []
    return d.config_path.read_bytes(), s["config"]["version"], s["batch"]["configured"], history


def _has_history(d: Daemon) -> bool:
    return configfile.history_dir(d.config_path).is_dir()


def _outcome(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-mlxd-outcome"]


# ---------------------------------------------------------------- access and CSRF


def test_stray_temp_files_are_removed_at_start(daemon: Daemon) -> None:
    assert not any(stray.exists() for stray in daemon.strays)
    assert daemon.keep.exists()
    assert "left by an interrupted config write" in daemon.log()


def test_post_without_csrf_token_is_refused(daemon: Daemon) -> None:
    editor = Editor(daemon)
    editor.load()
    before = _state(daemon)
    form = {"source": "quick", "base_sha256": editor.sha256, **QUICK_DEFAULTS, "batch.size": "5"}
    no_token = editor.client.post("/dashboard/config/apply", data=form)
    assert no_token.status_code == 403
    assert "CSRF" in no_token.text
    forged = {"X-CSRF-Token": "0" * 128}
    assert (
        editor.client.post("/dashboard/config/apply", data=form, headers=forged).status_code == 403
    )
    # A token without its cookie (another browser's page) is refused too.
    stranger = httpx.post(
        f"{daemon.url}/dashboard/config/apply",
        data=form,
        headers={**ADMIN, "X-CSRF-Token": editor.token},
    )
    assert stranger.status_code == 403
    assert _state(daemon) == before
    # The hidden form field works like the header (a browser without JavaScript).
    ok = editor.client.post(
        "/dashboard/config/validate", data={**form, "_csrf_token": editor.token}
    )
    assert ok.status_code == 200 and ok.headers["x-mlxd-outcome"] == "valid"
    assert "<html" in ok.text  # without htmx: the whole page, with the result
    assert _state(daemon) == before


def test_json_apis_need_no_csrf_token(daemon: Daemon) -> None:
    reload = httpx.post(f"{daemon.url}/admin/reload", headers=ADMIN, timeout=60)
    assert reload.status_code == 200, reload.text
    body = {
        "model": _model(daemon),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    chat = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert "mlxd_csrf" not in chat.headers.get("set-cookie", "")


def _model(d: Daemon) -> str:
    r = httpx.get(f"{d.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    return r.json()["data"][0]["id"]


def test_off_loopback_the_editor_needs_the_admin_token(daemon: Daemon) -> None:
    anonymous = Editor(daemon, headers={})
    page = anonymous.client.get("/dashboard/config")
    assert page.status_code == 401
    assert "admin token required" in page.text
    assert "/dashboard/login?next=/dashboard/config" in page.text
    assert ADMIN_TOKEN not in page.text and "base_sha256" not in page.text
    # Even with a valid CSRF cookie and token, a POST without the admin token is refused.
    token = anonymous.client.cookies["mlxd_csrf"]
    before = _state(daemon)
    anonymous.sha256, anonymous.token = "x", token
    refused = anonymous.quick("apply", batch__size="7")
    assert refused.status_code == 401 and "admin token required" in refused.text
    wrong = Editor(
        daemon, headers={"Authorization": f"Bearer {API_KEY}"}
    )  # an API key is no admin token
    assert wrong.client.get("/dashboard/config").status_code == 401
    assert _state(daemon) == before
    bearer = Editor(daemon, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    bearer.load()
    assert _outcome(bearer.quick("validate", batch__size="7")) == "valid"
    assert _state(daemon) == before


# ---------------------------------------------------------------- invalid input


INVALID = {
    "toml": ("raw", "[batch]\nsize = 3\nkv_budget = = 1\n", "line 3"),
    "typo": ("raw", "[batch]\nsise = 3\n", "[batch] sise"),
    "type": ("quick", {"batch.size": "three"}, "[batch] size"),
    "negative": ("quick", {"batch.kv_budget": "-5"}, "[batch] kv_budget"),
    "model-path": ("raw", "[model]\npath = '/no/such/model-dir'\n", "[model] path"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_input_changes_nothing(daemon: Daemon, case: str) -> None:
    source, value, named = INVALID[case]
    editor = Editor(daemon)
    editor.load()
    before = _state(daemon)
    for action in ("validate", "apply"):
        if source == "raw":
            r = editor.raw(action, value)
        else:
            r = editor.post(action, source="quick", **{**QUICK_DEFAULTS, **value})
        assert _outcome(r) == "rejected", r.text
        text = r.text.replace("&#34;", '"')
        if named.startswith("line"):
            assert re.search(r'data-field="line">3<', text), text
        else:
            assert named in text, text
        assert _state(daemon) == before, f"{case}: {action} changed something"
        if action == "apply" and source == "quick":
            assert "File diff, on disk → yours, not written" in r.text
    if case == "negative":
        assert "cannot be negative" in r.text
    # The refused apply is in the event log like any rejected reload.
    event = _stats(daemon)["reloads"][0]
    assert (event["trigger"], event["outcome"]) == ("dashboard", "rejected")


# ---------------------------------------------------------------- apply, backups, rollback


def test_apply_writes_round_trips_and_rolls_back(daemon: Daemon) -> None:
    editor = Editor(daemon)
    page = editor.load()
    assert API_KEY in page  # the raw editor shows the file...
    original, version, _, history = _state(daemon)

    validate = editor.quick("validate", batch__size="3", batch__kv_budget="24MiB")
    assert _outcome(validate) == "valid"
    assert re.search(r"batch\.size</code></td><td><code>2</code>.*<code>3</code>", validate.text)
    assert "comments and formatting are kept" in validate.text
    # The diff holds the two changed lines and nothing else.
    diff = html.unescape(validate.text.split('data-field="diff-label"', 1)[1])
    assert "on disk → yours (Validate writes nothing)" in diff
    dels = re.findall(r'class="d-del">([^<]*)<', diff)
    adds = re.findall(r'class="d-add">([^<]*)<', diff)
    assert dels == ["-size = 2", '-kv_budget = "16MiB"'], dels
    assert adds == ["+size = 3", '+kv_budget = "24MiB"'], adds
    assert API_KEY not in validate.text  # ...the diffs mask it
    assert daemon.config_path.read_bytes() == original

    applied = editor.quick("apply", batch__size="3", batch__kv_budget="24MiB")
    assert _outcome(applied) == "applied"
    assert applied.headers["hx-trigger"] == "config-applied"
    assert applied.headers["hx-retarget"] == "#config-editor"
    written = daemon.config_path.read_text()
    assert written.startswith("# written by hand, with a comment\n")  # edited in place
    assert "previous file → written" in applied.text
    settings = load_settings(daemon.config_path)
    assert (settings.batch.size, settings.batch.kv_budget) == (3, 24 * 1024**2)
    assert settings.server.api_keys[0].get_secret_value() == API_KEY
    assert settings.server.admin_token.get_secret_value() == ADMIN_TOKEN
    assert settings.sampling.temperature == 0.0 and settings.model.path
    s = _stats(daemon)
    assert s["config"]["version"] == version + 1
    assert s["batch"]["configured"] == 3 and s["batch"]["kv_budget_bytes"] == 24 * 1024**2
    backups = configfile.list_history(daemon.config_path)
    assert len(backups) == len(history) + 1
    assert backups[0].path.read_bytes() == original
    assert stat.S_IMODE(backups[0].path.stat().st_mode) == stat.S_IMODE(
        daemon.config_path.stat().st_mode
    )
    assert backups[0].name in applied.text  # the history lists it, with a rollback button

    # The raw editor writes exactly what was validated, comments included.
    editor.load()
    raw = written.replace("size = 3", "size = 4  # four rows") + "# trailing comment\n"
    assert _outcome(editor.raw("apply", raw)) == "applied"
    assert daemon.config_path.read_text() == raw
    assert _stats(daemon)["batch"]["configured"] == 4

    # Rollback to the hand-written original: file, /stats and the version follow.
    editor.load()
    rolled = editor.post("rollback", version=backups[0].name)
    assert _outcome(rolled) == "applied"
    assert daemon.config_path.read_bytes() == original
    s = _stats(daemon)
    assert s["batch"]["configured"] == 2 and s["batch"]["kv_budget_bytes"] == 16 * 1024**2
    assert s["config"]["version"] == version + 3
    newest = configfile.list_history(daemon.config_path)[0]
    assert newest.path.read_text() == raw  # the version rolled away from is kept too
    assert [e["trigger"] for e in s["reloads"][:3]] == ["dashboard"] * 3


def test_conflict_refuses_to_write(daemon: Daemon) -> None:
    editor = Editor(daemon)
    editor.load()
    on_disk = daemon.config_path.read_text() + "# edited with vim meanwhile\n"
    daemon.write_config(on_disk)
    before = _state(daemon)
    for action, r in [
        ("apply", editor.quick("apply", batch__size="5")),
        ("apply", editor.raw("apply", "[batch]\nsize = 6\n")),
    ]:
        assert _outcome(r) == "conflict", action
        html = r.text
        assert "# edited with vim meanwhile" in html  # the version on disk
        assert re.search(r'class="d-add">\+size = [56]<', html)  # the diff to yours
        assert _state(daemon) == before
    history = configfile.list_history(daemon.config_path)
    if history:
        rollback = editor.post("rollback", version=history[-1].name)
        assert _outcome(rollback) == "conflict"
    assert _state(daemon) == before
    # Reloading the editor picks the new file up; then applying works again.
    editor.load()
    assert _outcome(editor.quick("validate")) == "unchanged"


# ---------------------------------------------------------------- no config file


def test_without_a_config_file_the_editor_explains() -> None:
    settings = Settings()
    fleet = Fleet(settings, device_bytes=2**30, make_engine=_engine)  # never started
    state = AppState(fleet, settings, config_path=None)
    with TestClient(make_app(state)) as client:
        page = client.get("/dashboard/config")
        assert page.status_code == 200
        assert "No config file to edit" in page.text
        assert "mlxd serve --config mlxd.toml" in page.text
        token = client.cookies["mlxd_csrf"]
        r = client.post(
            "/dashboard/config/apply",
            data={"source": "raw", "text": "[batch]\nsize = 1\n"},
            headers={"X-CSRF-Token": token},
        )
        assert r.status_code == 409 and "without --config" in r.text


# ---------------------------------------------------------------- configfile


def test_atomic_write_keeps_permissions_and_follows_symlinks(tmp_path: Path) -> None:
    target = tmp_path / "real.toml"
    target.write_text("a = 1\n")
    target.chmod(0o640)
    link = tmp_path / "mlxd.toml"
    link.symlink_to(target)
    configfile.atomic_write(link, "a = 2\n")
    assert link.is_symlink() and target.read_text() == "a = 2\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlxd.toml", "real.toml"]  # no temp left
    fresh = tmp_path / "new.toml"
    configfile.atomic_write(fresh, "b = 1\n")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


def test_atomic_write_failure_leaves_the_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "mlxd.toml"
    path.write_text("a = 1\n")

    def broken(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        configfile.atomic_write(path, "a = 2\n")
    assert path.read_text() == "a = 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["mlxd.toml"]


def test_history_keeps_the_last_five(tmp_path: Path) -> None:
    path = tmp_path / "mlxd.toml"
    path.write_text("v = 0\n")
    for i in range(1, 8):
        sha = configfile.read_current(path).sha256
        backup = configfile.save(path, f"v = {i}\n", expected_sha256=sha)
        assert backup is not None and backup.path.read_text() == f"v = {i - 1}\n"
        time.sleep(0.002)
    backups = configfile.list_history(path)
    assert len(backups) == configfile.KEEP
    assert [b.path.read_text() for b in backups] == [f"v = {i}\n" for i in (6, 5, 4, 3, 2)]
    assert all(b.replaced_at <= time.time() + 1 for b in backups)
    assert backups[0].replaced_at >= backups[-1].replaced_at
    # Saving identical text writes nothing and keeps no copy.
    sha = configfile.read_current(path).sha256
    assert configfile.save(path, "v = 7\n", expected_sha256=sha) is None
    assert len(configfile.list_history(path)) == configfile.KEEP


def test_rollback_and_conflicts(tmp_path: Path) -> None:
    path = tmp_path / "mlxd.toml"
    path.write_text("v = 1\n")
    configfile.save(path, "v = 2\n", expected_sha256=configfile.read_current(path).sha256)
    [first] = configfile.list_history(path)
    loaded = configfile.read_current(path).sha256
    path.write_text("v = 3  # vim\n")  # someone else, after the editor loaded the file
    with pytest.raises(configfile.Conflict) as conflict:
        configfile.rollback(path, first.name, expected_sha256=loaded)
    assert conflict.value.disk.text == "v = 3  # vim\n"
    with pytest.raises(configfile.Conflict):
        configfile.save(path, "v = 4\n", expected_sha256=loaded)
    assert path.read_text() == "v = 3  # vim\n"
    assert len(configfile.list_history(path)) == 1
    text = configfile.rollback(
        path, first.name, expected_sha256=configfile.read_current(path).sha256
    )
    assert text == "v = 1\n" and path.read_text() == "v = 1\n"
    assert configfile.list_history(path)[0].path.read_text() == "v = 3  # vim\n"
    for bad in ("../mlxd.toml", "nope", f"../{first.name}"):
        with pytest.raises(KeyError):
            configfile.read_backup(path, bad)
