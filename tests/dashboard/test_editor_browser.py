"""The config editor in a real headless Chromium against the real daemon.

One walk through the page: a quick control is validated and applied and the
header follows; a file edited on disk meanwhile is a conflict that writes
nothing; invalid TOML in the raw editor names its line; the raw editor writes
byte for byte; one click rolls back. No console errors throughout.

Chromium comes from the system (``/usr/bin/chromium``, or ``$MLXD_CHROMIUM``);
without it the test skips, unless ``MLXD_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import pytest

from mlxd.dashboard import configfile
from tests.support.daemon import Daemon, toml_config

WAIT_MS = 10_000


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    config = "# tuned by hand\n" + toml_config(
        model={"path": str(tiny_models("llama"))}, batch={"size": 2, "kv_budget": "16MiB"}
    )
    # Its own: the editor rewrites its config file.
    return daemons.get(config, name="editor-browser")


def _field(page, name: str) -> str:
    return page.locator(f"#status-bar [data-field={name}]").inner_text().strip()


def _wait_mode(page, mode: str) -> None:
    """The status bar's mode, refreshed by the apply's HX-Trigger (or its own poll)."""
    page.wait_for_function(
        "m => document.querySelector('#status-bar [data-field=mode]').textContent.trim() === m",
        arg=mode,
        timeout=WAIT_MS,
    )


def _wait_outcome(page, outcome: str) -> None:
    page.locator(f"#config-result[data-outcome={outcome}]").wait_for(timeout=WAIT_MS)


def _submit(page, button: str, outcome: str) -> None:
    """Click a form button and wait for *its* result (a stale one cannot match)."""
    page.evaluate(
        "document.getElementById('config-result')?.setAttribute('data-outcome', 'pending')"
    )
    page.click(button)
    _wait_outcome(page, outcome)


@pytest.mark.browser
def test_edit_apply_conflict_and_rollback_in_a_browser(daemon: Daemon, pages) -> None:
    page = pages(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{daemon.url}/dashboard/config")
    page.wait_for_function("() => window.htmx && htmx.version.startsWith('2.0')")
    assert _field(page, "mode") == "batch 2"
    version = daemon.stats()["config"]["version"]
    assert _field(page, "config").startswith(f"v{version},")
    original = daemon.config_path.read_text()

    # Quick control: validate shows the diff, apply writes and reloads.
    page.fill("#q-batch-size", "1")
    _submit(page, "#config-quick button:text-is('Validate')", "valid")
    row = page.locator("#config-result tr[data-key='batch.size']")
    assert row.inner_text().split() == ["batch.size", "2", "→", "1", "live"]
    result = page.locator("#config-result")
    assert "comments and formatting are kept" in result.inner_text()
    # The diff shows the one changed line, nothing else of the file.
    assert (
        result.locator("[data-field=diff-label]").inner_text().endswith("(Validate writes nothing)")
    )
    assert result.locator(".diff .d-del").all_inner_texts() == ["-size = 2"]
    assert result.locator(".diff .d-add").all_inner_texts() == ["+size = 1"]
    assert daemon.config_path.read_text() == original
    _submit(page, "#config-quick button:text-is('Apply')", "applied")
    # Edited in place: the hand-written comment survives, only that line changed.
    assert daemon.config_path.read_text() == original.replace("size = 2", "size = 1")
    assert daemon.config_path.read_text().startswith("# tuned by hand\n")
    _wait_mode(page, "serial")
    assert _field(page, "config").startswith(f"v{version + 1},")
    assert daemon.stats()["batch"]["configured"] == 1
    assert page.locator("#config-history li[data-version]").count() == 1

    # Someone edits the file with vim after the page loaded it: nothing is written.
    on_disk = daemon.config_path.read_text() + "# edited with vim meanwhile\n"
    daemon.write_config(on_disk)
    page.fill("#q-batch-size", "3")
    _submit(page, "#config-quick button:text-is('Apply')", "conflict")
    result = page.locator("#config-result")
    assert "# edited with vim meanwhile" in result.locator("[data-field=disk]").inner_text()
    assert "size = 3" in result.locator("[data-field=yours]").inner_text()
    assert "+size = 3" in result.locator("[data-field=conflict-diff]").inner_text()
    assert daemon.config_path.read_text() == on_disk
    assert daemon.stats()["config"]["version"] == version + 1

    # Load the file on disk; invalid TOML in the raw editor names its line.
    page.click("#config-result a[href='/dashboard/config']")
    page.locator("#config-text").wait_for()
    assert "# edited with vim meanwhile" in page.input_value("#config-text")
    page.fill("#config-text", "[batch]\nsize = 2\nkv_budget = = 1\n")
    _submit(page, "#config-raw button:text-is('Apply')", "rejected")
    assert page.locator("#config-result [data-field=line]").inner_text() == "3"
    assert "invalid TOML" in page.locator("#config-result [data-field=reason]").inner_text()
    assert daemon.config_path.read_text() == on_disk

    # An unknown key: its line, and the near match among the section's keys.
    page.fill("#config-text", "# mine\n[batch]\nsize = 2\nprompt_concurency = 2\n")
    _submit(page, "#config-raw button:text-is('Apply')", "rejected")
    result = page.locator("#config-result")
    assert result.locator("[data-field=line]").inner_text() == "4"
    assert result.locator("[data-field=key]").inner_text() == "[batch] prompt_concurency"
    assert (
        "did you mean 'prompt_concurrency'?" in result.locator("[data-field=reason]").inner_text()
    )
    assert result.locator("[data-field=diff-label]").inner_text().endswith("not written")
    assert daemon.config_path.read_text() == on_disk

    # The raw editor writes what it validated, byte for byte, comments kept.
    text = on_disk.replace("size = 1", "size = 2  # two rows again")
    page.fill("#config-text", text)
    _submit(page, "#config-raw button:text-is('Apply')", "applied")
    assert daemon.config_path.read_text() == text
    _wait_mode(page, "batch 2")

    # One click rolls back to the version before (batch size 1).
    previous = configfile.list_history(daemon.config_path)[0]
    assert previous.path.read_text() == on_disk
    _submit(page, f"#config-history li[data-version='{previous.name}'] button", "applied")
    assert daemon.config_path.read_text() == on_disk
    _wait_mode(page, "serial")
    assert _field(page, "config").startswith(f"v{version + 3},")
    assert not problems, f"console errors: {problems}"
    page.close()
