"""Shared fixtures: model folders built or fetched once per session."""

import os

# Triton kernels run on CPU tensors through Triton's interpreter, which must be chosen before triton is imported.
if os.environ.get("TRITONLLM_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir():
    from tritonllm.checkpoints.smollm2 import smollm2_cached_dir

    return smollm2_cached_dir()


@pytest.fixture
def graphs_on_this_device(monkeypatch):
    """CUDA graphs in engines made by the test: real ones under TRITONLLM_TEST_DEVICE=cuda; elsewhere eager runs of
    the very forward a graph would hold, over the same static, padded inputs (narrow KV widths, so they vary)."""
    import os

    from tritonllm.engine.embedded import cuda_graphs, engine_core

    if os.environ.get("TRITONLLM_TEST_DEVICE", "cpu") != "cuda":

        def eager_capture(forward, pool):
            output = forward()
            return (lambda: output.copy_(forward())), output

        monkeypatch.setattr(engine_core, "graphs_supported", lambda device: True)
        monkeypatch.setattr(cuda_graphs, "capture", eager_capture)
    monkeypatch.setattr(cuda_graphs, "MIN_GRAPH_TOKENS", 16)


HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def fill_hub_cache():
    """fill(hub, "org/name", files) lays a model out as huggingface_hub caches it (hub/models--org--name/
    snapshots/<rev>/..., refs/main = <rev>) and returns the snapshot folder: Hub ids resolve offline, no network."""
    import shutil
    from pathlib import Path

    def fill(hub: Path, repo_id: str, files_from: Path) -> Path:
        repo = Path(hub) / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / HUB_REVISION
        shutil.copytree(files_from, snapshot)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(HUB_REVISION)
        return snapshot

    return fill
