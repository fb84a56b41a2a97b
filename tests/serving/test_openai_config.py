"""The frontend's start-up settings, and how `serve --openai-port` finds the model folder of a repository."""

from __future__ import annotations

import json
import shutil
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
        ({"max_tokens_default": 0}, "--max-tokens-default"),
        ({"max_tokens_limit": 0}, "--max-tokens-limit"),
        ({"max_tokens_default": 65, "max_tokens_limit": 64}, "must not exceed --max-tokens-limit"),
    ],
)
def test_bad_settings_are_refused_naming_the_option(tiny_dir, change, words):
    settings = {"triton_url": "localhost:8001", "model_dir": tiny_dir, "served_model_name": "tiny", **change}
    with pytest.raises(FrontendConfigError, match=words):
        FrontendConfig(**settings)


def _openai_args(model_dir, *extra):
    from tritonllm.commands.main import build_parser

    return build_parser().parse_args(["openai", "--triton-url", "h:1", "--model-dir", str(model_dir), *extra])


def test_max_tokens_default_from_the_options_or_generation_config(tiny_dir, tmp_path):
    from tritonllm.openai_api.config import DEFAULT_MAX_TOKENS

    assert config_from_args(_openai_args(tiny_dir)).max_tokens_default == DEFAULT_MAX_TOKENS
    assert config_from_args(_openai_args(tiny_dir, "--max-tokens-limit", "100")).max_tokens_default == 100
    config = config_from_args(_openai_args(tiny_dir, "--max-tokens-default", "7", "--max-tokens-limit", "9"))
    assert (config.max_tokens_default, config.max_tokens_limit) == (7, 9)
    folder = tmp_path / "with_generation_config"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 40}))
    assert config_from_args(_openai_args(folder)).max_tokens_default == 40  # as vLLM reads it
    with pytest.raises(FrontendConfigError, match="--max-tokens-default"):
        config_from_args(_openai_args(folder, "--max-tokens-default", "50", "--max-tokens-limit", "20"))


def test_serve_passes_the_max_tokens_options_to_the_endpoint():
    from tritonllm.commands.main import build_parser
    from tritonllm.deploy.frontend import max_tokens_arguments

    args = build_parser().parse_args(["serve", "--demo", "--openai-port", "9", "--max-tokens-limit", "64"])
    assert max_tokens_arguments(args) == ["--max-tokens-limit", "64"]


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(FrontendConfigError, match="config.json"):
        FrontendConfig(triton_url="h:1", model_dir=tmp_path, served_model_name="x")


def test_the_model_folder_of_a_built_repository(tiny_dir, tmp_path):
    repo = build_repo(tiny_dir, tmp_path / "repo")
    assert tokenizer_dir_of_repo(repo).resolve() == tiny_dir.resolve()
    with pytest.raises(FrontendStartError, match="preprocessing"):
        tokenizer_dir_of_repo(tmp_path / "empty")


@pytest.mark.parametrize("tokenizer_file", [None, "{not json"])
def test_openai_without_a_usable_tokenizer_exits_with_one_line_naming_model_dir(
    tiny_dir, tmp_path, capsys, tokenizer_file
):
    from tritonllm.commands.main import main

    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(tiny_dir / "config.json", folder)
    if tokenizer_file is not None:
        (folder / "tokenizer.json").write_text(tokenizer_file)
    assert main(["openai", "--triton-url", "localhost:1", "--model-dir", str(folder), "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out and "serving" not in captured.err + captured.out
    (line,) = captured.err.strip().splitlines()
    expected = "holds no tokenizer" if tokenizer_file is None else "cannot load its tokenizer (JSONDecodeError"
    assert line.startswith(f"tritonllm: error: --model-dir {folder}") and expected in line
