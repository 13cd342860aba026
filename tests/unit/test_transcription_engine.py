"""TranscriptionEngine (issue 37) driven as the fleet drives it: load, refuse, unload, stop.

The tiny random-weight Whisper is loaded for real; no upload is transcribed here
(tests/http/test_transcription.py does that), so each check is a refusal or a state.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxd.config import load_settings
from mlxd.engine import Failed, TranscriptionJob

pytest.importorskip("mlx_audio")


def test_load_refuse_unload_stop(tiny_whisper_model) -> None:
    from mlxd.engine.transcription.engine import TranscriptionEngine

    settings = load_settings(None, overrides={"model": {"path": str(tiny_whisper_model)}})
    engine = TranscriptionEngine(settings, "whisper")
    engine.start()
    job = TranscriptionJob(np.zeros(1600, dtype=np.float32), 0.1, language="zz")
    try:
        before = engine.submit(job).result(30)
        assert isinstance(before, Failed) and before.code == "model_not_loaded"
        info = engine.load(settings).result(60)
        assert info.family == "whisper" and info.weights_bytes > 0
        assert engine.weights_bytes == info.weights_bytes == engine.snapshot().weights_bytes
        assert engine.snapshot().state == "ready"
        refused = engine.submit(job).result(30)
        assert isinstance(refused, Failed) and refused.status == 400
        assert refused.param == "language" and "'zz'" in refused.message
        assert engine.snapshot().requests_failed == 2 and not engine.busy
        engine.unload().result(30)
        assert engine.info is None and engine.snapshot().state == "unloaded"
        assert engine.snapshot().weights_bytes == 0
        bad = load_settings(None, overrides={"model": {"path": str(tiny_whisper_model.parent)}})
        with pytest.raises(Exception, match=r"config\.json"):
            engine.load(bad).result(30)
        assert engine.snapshot().state == "failed"
    finally:
        engine.stop()
    assert not engine.alive and engine.snapshot().state == "stopped"
    stopped = engine.submit(job).result(1)
    assert isinstance(stopped, Failed) and stopped.code == "shutting_down"
