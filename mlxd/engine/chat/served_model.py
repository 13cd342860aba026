"""The model the engine serves: its first load, a swap for another, an unload.

Runs on the engine thread; a swap and an unload run as exclusive commands,
once both lanes are idle. Loading itself goes through the engine's hooks
(:mod:`mlxd.engine.chat.hooks`: here, or a shard on every rank of a cluster).
The loaded model's facts (:attr:`ServedModel.info`) and grammar compiler are
published for other threads to read.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxd.config import ModelSettings, SpeculativeSettings
from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.enqueue import prepare_queued_again
from mlxd.engine.chat.hooks import OneMachine
from mlxd.engine.chat.loading import LoadedModel, ModelLoadError
from mlxd.engine.chat.quant_load import with_quantized_kv
from mlxd.engine.chat.speculative.drafter import attach_draft
from mlxd.engine.chat.speculative.mtp_loading import attach_mtp
from mlxd.engine.messages import ModelInfo

if TYPE_CHECKING:
    from mlxd.engine.chat.grammar import Grammars

logger = logging.getLogger(__name__)


class ServedModel:
    """Loads, swaps and unloads ``core``'s model; ``publish`` shows a swap as it starts."""

    def __init__(self, core: EngineCore, *, optimized_blas: bool, publish: Callable[[], None]):
        self._core = core
        self._optimized_blas = optimized_blas
        self._publish = publish
        # Bumped by each swap: a prompt-cache key never outlives its model.
        self._generation = 0
        # Read from any thread (plain references, set on the engine thread).
        self.info: ModelInfo | None = None
        self.grammars: Grammars | None = None

    def load_first(self) -> str | None:
        """Load the model the settings name; returns why it did not load, or None."""
        core = self._core
        try:
            loaded = self._load(core.settings.model, core.settings.speculative)
        except ModelLoadError as exc:
            logger.error("%s", exc)
            core.model_status, core.model_error = "failed", str(exc)
        except Exception as exc:
            logger.exception("loading the model failed")
            core.model_status, core.model_error = "failed", f"loading the model failed: {exc!r}"
        else:
            core.install_model(loaded)
            self._published(loaded)
        if core.loaded is None:
            return core.model_error or "the model did not load"
        return None

    def swap(
        self, model: ModelSettings, speculative: SpeculativeSettings | None = None
    ) -> ModelInfo:
        """Serve ``model`` instead (the lanes are idle); on failure the old one stays."""
        core = self._core
        previous_status = core.model_status
        core.model_status = "swapping"
        self._publish()
        self._generation += 1
        try:
            loaded = self._load(model, speculative or core.settings.speculative)
        except Exception as exc:
            core.model_status = previous_status if core.loaded is not None else "failed"
            core.note_error(f"model swap failed: {exc}")
            raise
        core.install_model(loaded)
        prepare_queued_again(core)
        self._published(loaded)
        _free_device_memory()
        return loaded.info

    def unload(self) -> None:
        """Drop the model (the lanes are idle); the engine waits for the next load."""
        core = self._core
        if core.loaded is None:
            return
        core.release()
        core.model_status, core.model_error = "unloaded", None
        self.grammars = None
        self.info = None
        _free_device_memory()

    def _load(self, model: ModelSettings, speculative: SpeculativeSettings) -> LoadedModel:
        loaded = self._core.hooks.load(
            model, optimized_blas=self._optimized_blas, generation=self._generation
        )
        batch = self._core.settings.batch
        if batch.kv_bits:
            # Not in a cluster (every rank would have to agree) nor through mlx-vlm.
            if isinstance(self._core.hooks, OneMachine) and loaded.vision is None:
                loaded = with_quantized_kv(loaded, batch.kv_bits, batch.kv_group_size)
            else:
                logger.warning("[batch] kv_bits is ignored for this model (cluster or vision)")
        if speculative.mode == "mtp" and not isinstance(self._core.hooks, OneMachine):
            logger.warning('[speculative] mode = "mtp" is ignored in a cluster (no speculation)')
            return loaded
        return attach_mtp(attach_draft(loaded, speculative), speculative)

    def _published(self, loaded: LoadedModel) -> None:
        self.grammars = loaded.grammars
        self.info = loaded.info


def _free_device_memory() -> None:
    """Give the freed model's buffers back (a collection first: cycles hold arrays)."""
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()
