"""Shared fixtures: model folders built or fetched once per session."""
import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    from tritonllm.model_files.smollm2 import smollm2_cached_dir

    return smollm2_cached_dir()
