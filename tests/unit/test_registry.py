"""The model registry in the config: [models.<id>] tables, validation, routing (pure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.config import ConfigError, load_settings
from mlxd.config.registry import (
    DEMO_MODEL_ID,
    default_id,
    for_model,
    registry,
    registry_notes,
    resolve,
)
from mlxd.control import reload_lines

TWO = """
[memory]
budget = "8GiB"

[batch]
size = 8

[sampling]
temperature = 0.7

[models.qwen]
path = "/models/qwen"
default = true
pin = true
aliases = ["gpt-*", "claude-*"]

[models.coder]
path = "/models/coder"
keep_alive = "30m"
aliases = ["coder-exact"]
batch = { size = 2 }
sampling = { temperature = 0.1 }

[models.embed]
path = "/models/bge"
kind = "embedding"
"""


def load(tmp_path: Path, text: str):
    path = tmp_path / "mlxd.toml"
    path.write_text(text)
    return load_settings(path)


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    return str(err.value)


def test_a_registry_is_read_in_file_order_with_its_overrides(tmp_path):
    settings = load(tmp_path, TWO)
    assert list(registry(settings)) == ["qwen", "coder", "embed"]
    coder = for_model(settings, "coder")
    assert coder.model.name == "coder" and coder.model.path == "/models/coder"
    assert coder.batch.size == 2 and coder.sampling.temperature == 0.1
    assert coder.batch.prefill_step_size == settings.batch.prefill_step_size  # not overridden
    qwen = for_model(settings, "qwen")
    assert qwen.batch.size == 8 and qwen.sampling.temperature == 0.7
    assert registry(settings)["coder"].keep_alive == 1800.0
    assert registry(settings)["qwen"].keep_alive == "forever"
    assert settings.memory.budget == 8 * 1024**3


def test_routing_by_id_exact_alias_pattern_and_default(tmp_path):
    settings = load(tmp_path, TWO)
    assert resolve(settings, "coder") == "coder"
    assert resolve(settings, "coder-exact") == "coder"
    assert resolve(settings, "gpt-4o") == "qwen"
    assert resolve(settings, "claude-sonnet-4") == "qwen"
    assert resolve(settings, "") == "qwen" and resolve(settings, None) == "qwen"
    assert resolve(settings, None, "embedding") == "embed"  # the only one of its kind
    assert resolve(settings, "/models/coder") is None  # a path is not a name
    assert resolve(settings, "llama") is None
    assert default_id(settings, "chat") == "qwen"


def test_an_old_single_model_table_is_a_registry_of_one_pinned_default(tmp_path):
    settings = load(tmp_path, '[model]\npath = "/models/Qwen3-4B"\naliases = ["x-*"]\n')
    ((entry_id, entry),) = registry(settings).items()
    assert entry_id == "Qwen3-4B" and entry.pin and entry.default
    assert resolve(settings, "x-1") == "Qwen3-4B"
    assert for_model(settings, "Qwen3-4B").model.path == "/models/Qwen3-4B"
    demo = load(tmp_path, "")
    assert list(registry(demo)) == ["SmolLM2-135M-Instruct"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (TWO.replace("batch = { size = 2 }", "batch = { sise = 2 }"),
         "[models.coder.batch] sise: unknown key; did you mean 'size'?"),
        (TWO.replace("batch = { size = 2 }", "batch = { size = 0 }"),
         "[models.coder.batch] size: Input should be greater than or equal to 1"),
        (TWO.replace('keep_alive = "30m"', 'keep_alive = "half an hour"'),
         "[models.coder] keep_alive: 'half an hour' is not a duration"),
        (TWO.replace('keep_alive = "30m"', 'keep_alive = "30m"\ndefault = true'),
         "[models.coder] default: only one chat model may be the default (qwen, coder are)"),
        (TWO.replace('aliases = ["coder-exact"]', 'aliases = ["gpt-*"]'),
         "[models.coder] aliases: 'gpt-*' is already an alias of [models.qwen]"),
        (TWO.replace('aliases = ["coder-exact"]', 'aliases = ["qwen"]'),
         "[models.coder] aliases: 'qwen' is the id of another model"),
        (TWO + '\n[model]\npath = "/x"\n', "use either one [model] table or [models.<id>] tables"),
        (TWO.replace("[models.coder]", '[models."bad id"]'), "a model id is letters, digits"),
        (TWO.replace('path = "/models/coder"', 'path = "/models/coder"\nname = "other"'),
         "[models.coder] name: the table's name is the model id"),
        (TWO.replace("pin = true", "pin = true\nwarmup = true"),
         "[models.qwen] warmup: unknown key"),
        ('[models.e]\npath = "/m"\nkind = "embedding"\n',
         'the registry needs at least one kind = "chat" model'),
        (TWO + '[cluster]\nbackend = "ring"\n', "a cluster serves exactly one chat model"),
        (TWO + '[models.r]\nkind = "rerank"\n', '[models.r] path: a kind = "rerank" model needs'),
    ],
)  # fmt: skip
def test_registry_mistakes_name_the_key_and_line(tmp_path, text, expected):
    message = refused(tmp_path, text)
    assert expected in message, message
    assert str(tmp_path / "mlxd.toml") in message
    assert "line " in message  # every issue points at a line of the file


def test_a_duplicate_table_is_a_toml_error_with_its_line(tmp_path):
    message = refused(tmp_path, TWO + '\n[models.coder]\npath = "/again"\n')
    assert "invalid TOML" in message and "line" in message


def test_check_config_prints_the_effective_registry(tmp_path, tiny_models):
    path = tmp_path / "mlxd.toml"
    path.write_text(TWO)
    done = subprocess.run(
        [sys.executable, "-m", "mlxd", "check-config", str(path)], capture_output=True, text=True
    )
    # The directories do not exist: check-config names each entry's path.
    assert done.returncode == 1
    assert "[models.qwen] path" in done.stderr and "[models.embed] path" in done.stderr
    tiny = str(tiny_models("llama"))
    text = TWO.replace('path = "/models/qwen"\n', "")
    path.write_text(text.replace("/models/coder", tiny).replace("/models/bge", tiny))
    done = subprocess.run(
        [sys.executable, "-m", "mlxd", "check-config", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "#  qwen: built-in demo model (chat, default, pinned, keep_alive forever)" in done.stdout
    assert "#  coder: " in done.stdout and "keep_alive 1800s" in done.stdout
    assert "overrides batch.size=2, sampling.temperature=0.1" in done.stdout
    assert "#  embed: " in done.stdout and "(embedding, default" in done.stdout


def test_an_embedding_entry_without_a_path_is_the_demo_embedding_model(tmp_path):
    """Issue 22: it was refused ("an embedding model needs a path")."""
    config = tmp_path / "mlxd.toml"
    config.write_text('[models.chat]\n[models.minilm]\nkind = "embedding"\n')
    settings = load_settings(config)
    assert settings.models["minilm"].path is None
    assert resolve(settings, "", "embedding") == "minilm"


def test_a_path_less_chat_entry_answers_as_the_demo_model_and_the_reload_says_so(tmp_path):
    """Issue 33 item 2: the README's embedding recipe keeps the demo model's id."""
    single = load(tmp_path, "[model]\n")
    moved = load(tmp_path, '[models.demo]\n[models.minilm]\nkind = "embedding"\n')
    assert resolve(moved, DEMO_MODEL_ID) == "demo"
    assert DEMO_MODEL_ID in registry(moved)["demo"].aliases
    assert DEMO_MODEL_ID not in registry(moved)["minilm"].aliases
    notes = registry_notes(single, moved)
    assert any(f"model {DEMO_MODEL_ID} is now served as demo" in n for n in notes), notes
    assert any("demo is no longer pinned" in n and "pin = true" in n for n in notes), notes
    pinned = load(tmp_path, '[models.demo]\npin = true\n[models.minilm]\nkind = "embedding"\n')
    assert not any("pinned" in n for n in registry_notes(single, pinned))
    # An entry that takes the id itself, or another model's alias, wins over the implicit one.
    own = load(
        tmp_path, f'[models.demo]\n[models.other]\npath = "/m"\naliases = ["{DEMO_MODEL_ID}"]\n'
    )
    assert resolve(own, DEMO_MODEL_ID) == "other"
    gone = load(tmp_path, '[models.qwen]\npath = "/models/qwen"\n')
    (note,) = registry_notes(single, gone)
    assert f"model {DEMO_MODEL_ID} is no longer configured" in note and "404" in note
    lines, code = reload_lines(200, {"outcome": "applied", "notes": [note]})
    assert code == 0 and f"note: {note}" in lines
