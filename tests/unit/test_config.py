"""Settings: the TOML file, env overrides, errors that name file and key, the CLI check."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from mlxd.config import (
    SECTIONS,
    ConfigError,
    ModelEntry,
    ModelSettings,
    Settings,
    dump_toml,
    load_settings,
    parse_bytes,
    reload_class,
)
from mlxd.config.keys import KeyEntry
from tests.support import ROOT


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mlxd.toml"
    path.write_text(text)
    return path


def test_example_config_is_valid_and_equals_the_defaults():
    assert load_settings(ROOT / "config.example.toml") == Settings()


def test_values_from_the_file(tmp_path):
    s = load_settings(
        write(tmp_path, '[batch]\nsize = 3\nkv_budget = "6GiB"\n[server]\nport = 9001\n')
    )
    assert (s.batch.size, s.batch.kv_budget, s.server.port) == (3, 6 * 1024**3, 9001)
    assert s.sampling.max_tokens == 512  # untouched sections keep their defaults


def test_typo_in_a_nested_key_names_the_file_and_the_key(tmp_path):
    path = write(tmp_path, "[batch]\nbatch_sise = 4\n")
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    text = str(err.value)
    assert str(path) in text and "[batch] batch_sise" in text and "unknown key" in text
    assert "size" in text  # the known keys are listed


def test_unknown_key_has_its_line_and_a_near_match(tmp_path):
    text = "# comment\n[server]\nport = 9001\n\n[batch]\nsize = 2\nprompt_concurency = 2\n"
    text += '[lanes]\nlogprobs = "serial"\n[bach]\nsize = 1\n[sampling]\nzzz = 1\n'
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text))
    issues = {i.key: i for i in err.value.issues}
    typo = issues["[batch] prompt_concurency"]
    assert typo.line == 7 and "did you mean 'prompt_concurrency'?" in typo.reason
    assert issues["bach"].line == 10 and "did you mean 'batch'?" in issues["bach"].reason
    far = issues["[sampling] zzz"]
    assert far.line == 13 and "did you mean" not in far.reason  # nothing near: no guess
    assert "line 7: [batch] prompt_concurency" in str(err.value)


def test_wrong_type_has_its_line_even_as_a_dotted_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, '[server]\nport = 1\n\nbatch.size = "four"\n'))
    assert err.value.issues[0].line == 4  # inside [server], batch.size is server.batch
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, 'model.name = "x"\nbatch.size = "four"\n'))
    assert err.value.issues[0].line == 2


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="bacth: unknown section"):
        load_settings(write(tmp_path, "[bacth]\nsize = 4\n"))


def test_wrong_type_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"\[batch\] size: .*integer"):
        load_settings(write(tmp_path, '[batch]\nsize = "four"\n'))


def test_negative_budget_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"\[batch\] kv_budget: .*negative"):
        load_settings(write(tmp_path, "[batch]\nkv_budget = -5\n"))


@pytest.mark.parametrize("text", ["[batch]\nkv_budget = 0\n", "[memory]\nbudget = 0\n"])
def test_a_zero_budget_is_refused_in_words_that_fit_its_key(tmp_path, text):
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text))
    (issue,) = caught.value.issues
    assert 'must be a positive size such as 512MiB or 8GiB, or "auto"' in str(issue)
    assert "KV" not in str(issue)  # [memory] budget is not a KV budget


def test_invalid_toml_names_the_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, "[server]\nport = 8080\nhost = \n"))
    assert err.value.issues[0].line == 3
    assert "line 3" in str(err.value)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_settings(tmp_path / "nope.toml")


def test_env_overrides_the_file_and_flags_override_env(tmp_path, monkeypatch):
    path = write(tmp_path, "[batch]\nsize = 3\n[server]\nport = 9001\n")
    monkeypatch.setenv("MLXD_BATCH__SIZE", "5")
    monkeypatch.setenv("MLXD_SERVER__PORT", "9002")
    s = load_settings(path, overrides={"server": {"port": 9003}})
    assert (s.batch.size, s.server.port) == (5, 9003)


def test_bad_env_value_is_an_error(monkeypatch):
    monkeypatch.setenv("MLXD_BATCH__SIZE", "zero")
    with pytest.raises(ConfigError, match=r"\[batch\] size"):
        load_settings(None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GiB", 6 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("2GB", 2 * 10**9),
        ("1.5 KiB", 1536),
        (42, 42),
        ("100", 100),
    ],
)
def test_human_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["6 potatoes", "-1GiB", True, [1]])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(ValidationError):
        s.batch.size = 3  # type: ignore[misc]


def test_dump_round_trips_and_masks_secrets(tmp_path):
    s = load_settings(
        write(
            tmp_path,
            '[server]\napi_keys = ["sk-secret"]\nadmin_token = "tok"\n'
            '[batch]\nkv_budget = "3GiB"\n',
        )
    )
    text = dump_toml(s)
    assert "sk-secret" not in text and "tok" not in text.replace("token", "")
    assert 'kv_budget = "3GiB"' in text
    revealed = dump_toml(s, reveal_secrets=True)
    assert load_settings(write(tmp_path, revealed)) == s


def test_check_config_cli_prints_the_effective_config(tmp_path):
    path = write(tmp_path, "[batch]\nsize = 2\n")
    done = subprocess.run(
        [sys.executable, "-m", "mlxd", "check-config", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (
        "size = 2" in done.stdout
        and "[sampling]" in done.stdout
        and "max_tokens = 512" in done.stdout
    )


def test_check_config_cli_fails_with_the_key(tmp_path):
    path = write(tmp_path, "[limits]\nmax_queud = 3\n")
    done = subprocess.run(
        [sys.executable, "-m", "mlxd", "check-config", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 1 and "[limits] max_queud: unknown key" in done.stderr


def _documented_keys(text: str) -> set[str]:
    found, section = set(), None
    for line in text.splitlines():
        # An optional section ([cluster]) is shown commented out: absent is its default.
        if m := re.match(r"^#?\s*\[(\w+)(\.[^\]]+)?\]", line):
            section = m.group(1)
        elif (m := re.match(r"^#?\s*(\w+)\s*=", line)) and section:
            found.add(f"{section}.{m.group(1)}")
    return found


def all_keys(*, entry_keys: str = "own") -> set[str]:
    """Every key; a [models.<id>] entry's ``own`` keys, or ``all`` of them ([model]'s too)."""
    keys = {f"{s}.{k}" for s, model in SECTIONS.items() for k in model.model_fields}
    entry = set(ModelEntry.model_fields)
    if entry_keys == "own":
        entry -= set(ModelSettings.model_fields)
    return keys | {f"models.{k}" for k in entry} | {f"keys.{k}" for k in KeyEntry.model_fields}


def _reload_class(section: str, name: str) -> str:
    if section == "keys":
        return KeyEntry.model_fields[name].json_schema_extra["reload"]
    if section == "models":
        return ModelEntry.model_fields[name].json_schema_extra["reload"]
    return reload_class(section, name)


def test_every_setting_is_in_the_example_config():
    documented = _documented_keys((ROOT / "config.example.toml").read_text())
    assert all_keys() - documented == set()
    assert documented - all_keys(entry_keys="all") == set()


def test_every_setting_is_in_docs_configuration_with_default_and_reload_class():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for key in sorted(all_keys()):
        section, name = key.split(".")
        rows = [
            line
            for line in doc.splitlines()
            if line.startswith(f"| `{name}`") and f"[{section}]" in _section_of(doc, line)
        ]
        assert rows, f"{key} is not documented in docs/configuration.md"
        assert _reload_class(section, name) in rows[0], f"{key}: reload class not stated"


def _section_of(doc: str, row: str) -> str:
    before = doc[: doc.index(row)]
    headings = re.findall(r"^## `\[(\w+)[^\]]*\]`", before, flags=re.M)
    return f"[{headings[-1]}]" if headings else ""


@pytest.mark.parametrize(
    "text", ['[server]\napi_keys = "sk-live-abc"\n', '[server]\nadmin_token = ["sk-live-abc"]\n']
)
def test_config_errors_never_repeat_a_secret(tmp_path, text):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text))
    assert "sk-live-abc" not in str(err.value)
    assert "[server]" in str(err.value)


def test_text_is_validated_for_a_path_that_does_not_exist_yet(tmp_path):
    s = load_settings(tmp_path / "new.toml", text="[batch]\nsize = 2\n")
    assert s.batch.size == 2


def test_serve_with_a_missing_config_file_exits_with_the_reason(tmp_path):
    missing = tmp_path / "nope.toml"
    done = subprocess.run(
        [sys.executable, "-m", "mlxd", "serve", "--config", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert str(missing) in done.stderr and "file not found" in done.stderr


@pytest.mark.slow
def test_demo_model_cli_prints_a_loadable_directory():
    done = subprocess.run(
        [sys.executable, "-m", "mlxd", "demo-model", "--dtype", "q4"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
