"""model.yaml's `model` / `tokenizer` as a folder or a Hugging Face id (tritonllm.checkpoints.model_ref), resolved
through a hub cache folder the test fills (HF_HOME in tmp, models--org--name/snapshots/<rev> + refs/main), offline:
never the network. Both readers of model.yaml (the LLM-API model and tensorrt_llm) use it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tritonllm.checkpoints.model_ref import hub_cache_dir, is_hub_id, resolve_model_ref
from tritonllm.engine.config import ConfigError
from tritonllm.triton.engine_args import load_tensorrt_llm_settings


@pytest.fixture
def model_files(tmp_path) -> Path:
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def hub_home(tmp_path, monkeypatch, model_files, fill_hub_cache) -> Path:
    """HF_HOME in tmp with acme/tiny-llama cached; offline."""
    home = tmp_path / "hf_home"
    fill_hub_cache(home / "hub", "acme/tiny-llama", model_files)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def snapshot_of(home: Path) -> Path:
    (snapshot,) = (home / "hub" / "models--acme--tiny-llama" / "snapshots").iterdir()
    return snapshot


def test_an_existing_folder_wins_over_a_hub_id(tmp_path, hub_home):
    (tmp_path / "acme" / "tiny-llama").mkdir(parents=True)
    assert resolve_model_ref("acme/tiny-llama", "model", "model.yaml", base_dir=tmp_path) == str(
        tmp_path / "acme" / "tiny-llama"
    )


def test_a_hub_id_resolves_to_its_cached_snapshot_under_hf_home(tmp_path, hub_home):
    snapshot = snapshot_of(hub_home)
    assert hub_cache_dir() == str(hub_home / "hub")
    assert Path(resolve_model_ref("acme/tiny-llama", "model", "model.yaml", base_dir=tmp_path)) == snapshot


def test_neither_a_folder_nor_resolvable_names_the_key_and_the_cache(tmp_path, hub_home):
    with pytest.raises(ConfigError) as caught:
        resolve_model_ref("acme/not-cached", "tokenizer", "x/model.yaml", base_dir=tmp_path)
    message = str(caught.value)
    assert message.startswith("x/model.yaml: tokenizer 'acme/not-cached' is neither a folder")
    assert str(hub_home / "hub") in message and "HF_HUB_OFFLINE is set" in message


@pytest.mark.parametrize("value", ["/abs/missing", "./rel", "~/x", "a/b/c", "has space"])
def test_paths_are_never_taken_for_hub_ids(value):
    assert not is_hub_id(value)
    assert resolve_model_ref(value, "model", "model.yaml") is not None  # left as a path; the loader says it is missing


def test_the_environment_is_read_at_each_call(monkeypatch, tmp_path):
    """HF_TOKEN, the cache and offline mode reach snapshot_download as they are when model.yaml is read."""
    import huggingface_hub

    seen = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: seen.update(kw) or str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    resolve_model_ref("acme/tiny-llama", "model", "model.yaml", base_dir=tmp_path)
    assert seen == {"cache_dir": str(tmp_path / "cache"), "local_files_only": False, "token": "hf_secret"}


def test_the_tensorrt_llm_models_yaml_resolves_hub_ids_too(tmp_path, hub_home):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.yaml").write_text(yaml.safe_dump({"model": "acme/tiny-llama"}))
    config = {"name": "tensorrt_llm", "max_batch_size": 8, "parameters": {}}
    settings = load_tensorrt_llm_settings(config, tmp_path)
    assert Path(settings.engine.model) == snapshot_of(hub_home)
