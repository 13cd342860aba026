"""``[speculative]``: its keys, its checks, per model, and a reload seeing a change."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.config import ConfigError, load_settings
from mlxd.config.registry import for_model


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mlxd.toml"
    path.write_text(text)
    return path


def test_defaults_are_off_and_a_mode_is_read(tmp_path):
    assert load_settings(write(tmp_path, "")).speculative.mode == "off"
    s = load_settings(
        write(tmp_path, '[speculative]\nmode = "prompt_lookup"\nmax_draft_tokens = 6\n')
    )
    assert (s.speculative.mode, s.speculative.max_draft_tokens) == ("prompt_lookup", 6)
    # mode = "mtp" is read; a model without an MTP head is refused when it loads.
    assert load_settings(write(tmp_path, '[speculative]\nmode = "mtp"\n')).speculative.mode == "mtp"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('mode = "eagle"', "mode"),
        ("max_draft_tokens = 0", "max_draft_tokens"),
        ("max_draft_tokens = 17", "max_draft_tokens"),
        ("ngram_min = 3\nngram_max = 2", "ngram_min (3) is above ngram_max (2)"),
        ('mode = "draft"', "needs draft_model"),
    ],
)
def test_bad_values_are_refused_with_the_reason(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, f"[speculative]\n{text}\n"))
    assert words in str(err.value)


def test_a_model_entry_overrides_the_table(tmp_path):
    text = (
        "[speculative]\nmax_draft_tokens = 3\n[models.a]\ndefault = true\n"
        'speculative = { mode = "prompt_lookup" }\n[models.b]\n'
    )
    s = load_settings(write(tmp_path, text))
    a, b = for_model(s, "a").speculative, for_model(s, "b").speculative
    assert (a.mode, a.max_draft_tokens) == ("prompt_lookup", 3)
    assert (b.mode, b.max_draft_tokens) == ("off", 3)


def test_a_model_entry_that_breaks_the_merged_table_is_refused(tmp_path):
    text = "[speculative]\nngram_max = 2\n[models.a]\nspeculative = { ngram_min = 3 }\n"
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text))
    assert "[models.a] speculative" in str(err.value) and "ngram_min (3)" in str(err.value)
