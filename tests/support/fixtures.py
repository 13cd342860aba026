"""Pytest fixtures for the tiny random-weight mlx-lm models in ``tests/support/tinymodels.py``.

Every test sees them: ``tests/conftest.py`` registers this module in ``pytest_plugins``.

Fixtures:

- ``tiny_models`` (session): a factory ``tiny_models(family, *, dtype="float32", seed=0)``
  returning the path of a cached model directory, ready for ``mlx_lm.load(path)``.
- ``tiny_loaded`` (session): a factory with the same arguments returning
  ``(model, tokenizer)`` from the real ``mlx_lm.load``, loaded once per session and shared
  (models are stateless between calls: the prompt caches live outside them).
- ``tiny_embedding_model`` (session): the path of the tiny random-weight BERT embedding
  model (``tests/support/tinyembed.py``), ready for ``mlx_embeddings.utils.load(path)``.
- ``tiny_model_path`` (function): one model directory, chosen by indirect parametrization
  (``"llama"`` when not parametrized)::

      @pytest.mark.parametrize("tiny_model_path", ["llama", "gemma3_text"], indirect=True)
      def test_something(tiny_model_path): ...

Builds go to ``$MLXD_CACHE_DIR/tiny-models`` when ``MLXD_CACHE_DIR`` is set, else
``~/.cache/mlxd/tiny-models``; each takes a few tens of milliseconds and is reused by later
sessions (and safely shared by parallel workers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.tinymodels import tiny_model_dir

__all__ = ["tiny_embedding_model", "tiny_loaded", "tiny_model_path", "tiny_models"]

TinyModels = Callable[..., Path]
TinyLoaded = Callable[..., tuple[Any, Any]]


@pytest.fixture(scope="session")
def tiny_models() -> TinyModels:
    """Factory ``(family, *, dtype="float32", seed=0) -> Path`` of a built model dir."""
    built: dict[tuple[str, str, int], Path] = {}

    def get(family: str, *, dtype: str = "float32", seed: int = 0) -> Path:
        key = (family, dtype, seed)
        if key not in built:
            built[key] = tiny_model_dir(family, dtype=dtype, seed=seed)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_loaded(tiny_models: TinyModels) -> TinyLoaded:
    """Factory ``(family, *, dtype="float32", seed=0) -> (model, TokenizerWrapper)``."""
    import mlx_lm

    loaded: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def get(family: str, *, dtype: str = "float32", seed: int = 0) -> tuple[Any, Any]:
        key = (family, dtype, seed)
        if key not in loaded:
            loaded[key] = mlx_lm.load(str(tiny_models(family, dtype=dtype, seed=seed)))
        return loaded[key]

    return get


@pytest.fixture
def tiny_model_path(request: pytest.FixtureRequest, tiny_models: TinyModels) -> Path:
    """The model dir for the family given by indirect parametrization (default llama)."""
    return tiny_models(getattr(request, "param", "llama"))


@pytest.fixture(scope="session")
def tiny_embedding_model() -> Path:
    """The tiny BERT embedding model's directory (built once, cached by content hash)."""
    from tests.support.tinyembed import tiny_embedding_dir

    return tiny_embedding_dir()


@pytest.fixture(scope="session")
def tiny_whisper_model() -> Path:
    """The tiny random-weight Whisper's directory (built once, cached)."""
    from tests.support.tinywhisper import tiny_whisper_dir

    return tiny_whisper_dir()


@pytest.fixture(scope="session")
def tiny_tts_model() -> Path:
    """The tiny Soprano text-to-speech model's directory (built once, cached)."""
    from tests.support.tinytts import tiny_tts_dir

    return tiny_tts_dir()
