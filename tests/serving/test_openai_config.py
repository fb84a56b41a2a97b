"""The frontend's start-up settings, and how `serve --openai-port` finds the model folder of a repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.openai import config_from_args
from tritonllm.deploy.frontend import FrontendStartError, tokenizer_dir_of_repo
from tritonllm.deploy.repo import build_repo
from tritonllm.openai_api.config import FrontendConfig, FrontendConfigError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_defaults_from_the_command_line(tiny_dir):
    from tritonllm.commands.main import build_parser

    args = build_parser().parse_args(
        [
            "openai",
            "--triton-url",
            "localhost:8001",
            "--model-dir",
            str(tiny_dir),
            "--lora-name",
            "a",
            "--lora-name",
            "b",
        ]
    )
    config = config_from_args(args)
    assert config.served_model_name == tiny_dir.name and config.backend_model == "tensorrt_llm_bls"
    assert config.model_names == (tiny_dir.name, "a", "b") and config.port == 9000


@pytest.mark.parametrize(
    "change, words",
    [
        ({"triton_url": "localhost"}, "--triton-url"),
        ({"backend_model": "tensorrt_llm"}, "--backend-model"),
        ({"lora_names": ("tiny",)}, "repeated: tiny"),
        ({"max_model_len": 1}, "--max-model-len"),
        ({"served_model_name": ""}, "--served-model-name"),
    ],
)
def test_bad_settings_are_refused_naming_the_option(tiny_dir, change, words):
    settings = {"triton_url": "localhost:8001", "model_dir": tiny_dir, "served_model_name": "tiny", **change}
    with pytest.raises(FrontendConfigError, match=words):
        FrontendConfig(**settings)


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(FrontendConfigError, match="config.json"):
        FrontendConfig(triton_url="h:1", model_dir=tmp_path, served_model_name="x")


def test_the_model_folder_of_a_built_repository(tiny_dir, tmp_path):
    repo = build_repo(tiny_dir, tmp_path / "repo")
    assert tokenizer_dir_of_repo(repo).resolve() == tiny_dir.resolve()
    with pytest.raises(FrontendStartError, match="preprocessing"):
        tokenizer_dir_of_repo(tmp_path / "empty")
