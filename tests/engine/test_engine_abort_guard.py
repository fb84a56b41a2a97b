"""A failing abort must not stop the engine thread: the aborted request gets an error, the others finish."""

import pytest

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.seam import EngineError
from tritonllm.engine.types import SamplingParams


def test_an_abort_that_raises_fails_only_its_request(tmp_path, monkeypatch):
    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    engine = EmbeddedEngine(EngineConfig.from_dict({"model": str(model_dir), "dtype": "float32", "device": "cpu"}))
    try:

        def broken_abort(request_id):
            raise RuntimeError("broken abort")

        monkeypatch.setattr(engine.core, "abort_request", broken_abort)
        victim = engine.generate_async([1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True))
        other = engine.generate_async([4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
        victim.abort()
        with pytest.raises(EngineError, match="could not be aborted"):
            victim.result(timeout=60)
        assert len(other.result(timeout=60).outputs[0].token_ids) == 8
        assert len(engine.generate([7, 8], SamplingParams(max_tokens=4, ignore_eos=True)).outputs[0].token_ids) == 4
    finally:
        monkeypatch.undo()
        engine.shutdown()
