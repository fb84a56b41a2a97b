"""The serving tests run the Triton models against tests/fake_pb_utils.py: loaded once here and registered as the
module `fake_pb_utils`, so that each test module can `import fake_pb_utils as fake`."""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest


def _load_fake_pb_utils():
    path = Path(__file__).resolve().parents[1] / "fake_pb_utils.py"
    spec = importlib.util.spec_from_file_location("fake_pb_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.modules.setdefault("fake_pb_utils", _load_fake_pb_utils())


@contextlib.contextmanager
def _loaded_llmapi_model(repo: Path):
    """The LLM-API model of a built repository, initialized on the fake pb_utils (put back afterwards)."""
    fake = sys.modules["fake_pb_utils"]
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = fake
    fake.MetricFamily.families = {}
    fake.model_dir = str(repo / "tensorrt_llm" / "1")
    from tritonllm.models.llmapi import TritonPythonModel

    instance = TritonPythonModel()
    config = TritonPythonModel.auto_complete_config(fake.ModelConfig({"name": "tensorrt_llm"})).as_dict()
    instance.initialize(
        {
            "model_config": json.dumps(config),
            "model_name": "tensorrt_llm",
            "model_version": "1",
            "model_repository": str(repo / "tensorrt_llm"),
        }
    )
    try:
        yield instance
    finally:
        instance.finalize()
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


@pytest.fixture(scope="session")
def load_llmapi_model():
    """`with load_llmapi_model(repo) as model:` the LLM-API model of `repo` on the fake pb_utils."""
    return _loaded_llmapi_model
