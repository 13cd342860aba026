"""The ``[embeddings]`` extra, as a new user meets it (issue 33 item 7).

``make embeddings`` installs it into ``.venv`` without pip's red resolver
``ERROR`` about the demo wheels' skipped dependencies; ``mlxd check-config``
warns about an embedding entry while it is missing; the README names the
target on the ``make serve`` path.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mlxd.cli import main
from tests.support import ROOT

EMBEDDING = '[models.chat]\n[models.minilm]\nkind = "embedding"\n'


def _without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "mlx_embeddings"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlx_embeddings", None)  # find_spec: None


def test_check_config_warns_about_a_missing_extra(tmp_path: Path, monkeypatch, capsys):
    path = tmp_path / "mlxd.toml"
    path.write_text(EMBEDDING, encoding="utf-8")
    _without_the_extra(monkeypatch)
    assert main(["check-config", str(path)]) == 0  # still valid: a warning, not an error
    err = capsys.readouterr().err
    assert "warning: [models.minilm]" in err and "mlx-embeddings" in err
    assert "make embeddings" in err and f"{sys.executable} -m pip install" in err
    path.write_text("[models.chat]\n", encoding="utf-8")
    assert main(["check-config", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err  # no embedding entry, no warning


def test_make_embeddings_installs_the_extra_without_the_resolver_error():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^embeddings: \$\(VENV\)/\.embeddings-ok$", makefile, re.M)
    recipes = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\$\(VENV\)/\.([\w-]+):.*\n((?:\t.*\n)+)", makefile, re.M)
    }
    # Installs after the demo wheels (installed --no-deps on purpose) skip pip's
    # resolver check, which would print a red ERROR about their dependencies.
    assert "--no-warn-conflicts -e '.[embeddings]'" in recipes["embeddings-ok"]
    assert "--no-warn-conflicts -e '.[test,embeddings,audio]'" in recipes["test-ok"]
    assert "--no-deps" in recipes["serve-ok"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "**`make embeddings`**" in readme
