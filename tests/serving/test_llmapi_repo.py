"""The LLM-API model's template (contract 1.3 tensors), its model.yaml settings, and `tritonllm repo build --llmapi`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tritonllm.commands.main import main as cli_main
from tritonllm.deploy.llmapi_repo import build_llmapi_repo, llmapi_template
from tritonllm.deploy.repo import RepoError, build_repo
from tritonllm.engine.config import ConfigError
from tritonllm.triton.llmapi_config import TritonConfig, load_llmapi_settings, read_triton_config

text_format = pytest.importorskip("google.protobuf.text_format")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")

# TensorRT-LLM's current triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt (docs/llmapi-io.md), plus the
# logits post-processor input its helpers read and the inflight-batcher models' two guided-decoding inputs.
CONTRACT_INPUTS = {  # name -> (data type, dims, optional)
    "text_input": ("TYPE_STRING", [-1], False),
    "image_url": ("TYPE_STRING", [-1], True),
    "streaming": ("TYPE_BOOL", [1], True),
    "sampling_param_best_of": ("TYPE_INT32", [1], True),
    "sampling_param_temperature": ("TYPE_FP32", [1], True),
    "sampling_param_top_k": ("TYPE_INT32", [1], True),
    "sampling_param_top_p": ("TYPE_FP32", [1], True),
    "sampling_param_frequency_penalty": ("TYPE_FP32", [1], True),
    "sampling_param_presence_penalty": ("TYPE_FP32", [1], True),
    "sampling_param_max_tokens": ("TYPE_INT32", [1], True),
    "sampling_param_stop": ("TYPE_STRING", [-1], True),
    "sampling_param_seed": ("TYPE_UINT64", [1], True),
    "sampling_param_exclude_input_from_output": ("TYPE_BOOL", [1], True),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", [1], True),
    "sampling_param_logits_post_processor_name": ("TYPE_STRING", [1], True),
    "guided_decoding_guide_type": ("TYPE_STRING", [1], True),
    "guided_decoding_guide": ("TYPE_STRING", [1], True),
    "return_finish_reason": ("TYPE_BOOL", [1], True),
    "return_stop_reason": ("TYPE_BOOL", [1], True),
    "return_cumulative_logprob": ("TYPE_BOOL", [1], True),
    "stop": ("TYPE_BOOL", [1], True),
    "lora_id": ("TYPE_UINT64", [1], True),
    "lora_name": ("TYPE_STRING", [1], True),
    "lora_path": ("TYPE_STRING", [1], True),
    "lora_ckpt_source": ("TYPE_STRING", [1], True),
}
CONTRACT_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]),
    "finish_reason": ("TYPE_STRING", [-1]),
    "stop_reason": ("TYPE_STRING", [-1]),
    "cumulative_logprob": ("TYPE_FP32", [-1]),
    "kv_cache_reused_block": ("TYPE_INT32", [-1]),
    "kv_cache_missed_block": ("TYPE_INT32", [-1]),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", [-1]),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", [-1]),
    "kv_cache_hit_rate": ("TYPE_FP32", [-1]),
    "arrival_time_ns": ("TYPE_INT64", [1]),
    "first_scheduled_time_ns": ("TYPE_INT64", [1]),
    "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]),
    "acceptance_rate": ("TYPE_FP32", [1]),
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}


@pytest.fixture
def fake_model(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    return model


def parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_the_template_declares_the_contract_tensors_and_leaves_batching_to_model_yaml():
    config = parse(llmapi_template() / "config.pbtxt")
    dtype = model_config_pb2.DataType.Name
    assert {t.name: (dtype(t.data_type), list(t.dims), t.optional) for t in config.input} == CONTRACT_INPUTS
    assert {t.name: (dtype(t.data_type), list(t.dims)) for t in config.output} == CONTRACT_OUTPUTS
    assert config.name == "tensorrt_llm" and config.backend == "python"
    assert config.max_batch_size == 0 and not config.HasField("model_transaction_policy")
    assert (llmapi_template() / "1" / "model.py").read_text().count("\nfrom ") == 1


def test_the_template_model_yaml_is_complete_except_for_the_model(tmp_path):
    version = llmapi_template() / "1"
    assert read_triton_config(version / "model.yaml").max_batch_size == 0
    with pytest.raises(ConfigError, match="'model' is unset"):
        load_llmapi_settings(version)


def test_build_writes_only_the_llmapi_model_with_a_loadable_model_yaml(fake_model, tmp_path):
    repo = build_llmapi_repo(
        fake_model,
        tmp_path / "repo",
        streaming=False,
        max_seq_len=512,
        kv_cache_max_tokens=4096,
        engine_args={"kv_cache_config.tokens_per_block": 16},
    )
    assert sorted(p.name for p in repo.iterdir()) == ["tensorrt_llm"]
    version = repo / "tensorrt_llm" / "1"
    data = yaml.safe_load((version / "model.yaml").read_text())
    assert data["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    assert data["kv_cache_config"] == {"max_tokens": 4096, "tokens_per_block": 16}
    settings = load_llmapi_settings(version)
    assert settings.engine.model == str(fake_model.resolve()) == settings.tokenizer_dir
    assert settings.engine.max_seq_len == 512 and settings.engine.kv_cache_config.tokens_per_block == 16
    assert not settings.triton.decoupled
    parse(repo / "tensorrt_llm" / "config.pbtxt")


def test_a_relative_model_path_is_relative_to_model_yaml(fake_model, tmp_path):
    repo = build_llmapi_repo(fake_model, tmp_path / "repo")
    version = repo / "tensorrt_llm" / "1"
    data = yaml.safe_load((version / "model.yaml").read_text())
    data["model"] = "../../../model"
    (version / "model.yaml").write_text(yaml.safe_dump(data))
    assert load_llmapi_settings(version).engine.model == str(fake_model.resolve())


@pytest.mark.parametrize(
    "triton_config, message",
    [
        ({"max_batch_size": -1, "decoupled": True}, "max_batch_size = -1 must be an integer >= 0"),
        ({"max_batch_size": True}, "max_batch_size = True must be an integer >= 0"),
        ({"cancellation_check_period_ms": 0}, "cancellation_check_period_ms = 0 must be an integer >= 1"),
        ({"multimodal": True}, "triton_config.multimodal = True is not supported"),
        ({"decoupled": "yes"}, "decoupled = 'yes' must be true or false"),
        ({"decoupled": True, "batching": 1}, "unknown key"),
        (None, "triton_config must be a mapping"),
    ],
)
def test_bad_triton_config_is_refused_naming_the_key(fake_model, tmp_path, triton_config, message):
    version = build_llmapi_repo(fake_model, tmp_path / "repo") / "tensorrt_llm" / "1"
    data = yaml.safe_load((version / "model.yaml").read_text())
    data["triton_config"] = triton_config
    (version / "model.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message):
        load_llmapi_settings(version)


def test_llm_config_path_picks_another_file(fake_model, tmp_path, monkeypatch):
    version = build_llmapi_repo(fake_model, tmp_path / "repo") / "tensorrt_llm" / "1"
    data = yaml.safe_load((version / "model.yaml").read_text())
    (version / "other.yaml").write_text(yaml.safe_dump({**data, "max_seq_len": 99}))
    monkeypatch.setenv("LLM_CONFIG_PATH", "other.yaml")
    assert load_llmapi_settings(version).engine.max_seq_len == 99


def test_keys_the_embedded_engine_cannot_honour_fail_the_build(fake_model, tmp_path):
    with pytest.raises(RepoError, match="cannot honour: pytorch_backend_config"):
        build_llmapi_repo(
            fake_model,
            tmp_path / "repo",
            engine="embedded",
            engine_args={"pytorch_backend_config": {"enable_overlap_scheduler": True}},
        )
    with pytest.raises(RepoError, match="unknown key"):
        build_llmapi_repo(fake_model, tmp_path / "repo", engine_args={"kv_cache_config.colour": "blue"})
    assert not (tmp_path / "repo" / "tensorrt_llm").exists()


def test_the_ensemble_models_and_the_llmapi_model_never_share_a_repository(fake_model, tmp_path):
    build_repo(fake_model, tmp_path / "repo")
    with pytest.raises(RepoError, match="same model name"):
        build_llmapi_repo(fake_model, tmp_path / "repo", overwrite=True)


def test_an_existing_llmapi_model_is_replaced_only_with_overwrite(fake_model, tmp_path):
    build_llmapi_repo(fake_model, tmp_path / "repo")
    with pytest.raises(RepoError, match="overwrite"):
        build_llmapi_repo(fake_model, tmp_path / "repo")
    build_llmapi_repo(fake_model, tmp_path / "repo", max_seq_len=64, overwrite=True)
    assert load_llmapi_settings(tmp_path / "repo" / "tensorrt_llm" / "1").engine.max_seq_len == 64


def test_the_cli_builds_it_with_typed_params(fake_model, tmp_path, capsys):
    out = tmp_path / "repo"
    assert (
        cli_main(
            [
                "repo",
                "build",
                "--llmapi",
                "--model",
                str(fake_model),
                "--out",
                str(out),
                "--no-streaming",
                "--max-batch-size",
                "4",
                "--param",
                "kv_cache_config.enable_block_reuse=false",
                "--param",
                "max_num_tokens=1024",
            ]
        )
        == 0
    )
    assert "LLM-API" in capsys.readouterr().out
    settings = load_llmapi_settings(out / "tensorrt_llm" / "1")
    assert settings.engine.max_batch_size == 4 and settings.engine.max_num_tokens == 1024
    assert settings.engine.kv_cache_config.enable_block_reuse is False and not settings.triton.decoupled


def test_triton_config_params_are_honoured_or_refused_never_dropped(fake_model, tmp_path):
    out = tmp_path / "repo"
    params = ["triton_config.decoupled=false", "triton_config.max_batch_size=8"]
    params += ["triton_config.cancellation_check_period_ms=25"]
    argv = ["repo", "build", "--llmapi", "--model", str(fake_model), "--out", str(out)]
    assert cli_main(argv + [arg for param in params for arg in ("--param", param)]) == 0
    data = yaml.safe_load((out / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert data["triton_config"] == {"max_batch_size": 8, "decoupled": False, "cancellation_check_period_ms": 25}
    settings = load_llmapi_settings(out / "tensorrt_llm" / "1")
    assert settings.triton == TritonConfig(max_batch_size=8, decoupled=False, cancellation_check_period_ms=25)
    assert settings.cancellation_check_period_ms == 25
    with pytest.raises(RepoError, match=r"triton_config has unknown key\(s\) \['batching'\]"):
        build_llmapi_repo(fake_model, tmp_path / "other", engine_args={"triton_config.batching": 1})
    with pytest.raises(RepoError, match="triton_config.multimodal = True is not supported"):
        build_llmapi_repo(fake_model, tmp_path / "other", engine_args={"triton_config.multimodal": True})


def test_model_as_a_hugging_face_id_resolves_through_the_hub_cache(fake_model, tmp_path, monkeypatch, fill_hub_cache):
    """TensorRT-LLM's documented flow names `model:` by its Hub id; here from a pre-filled HF_HOME, offline."""
    snapshot = fill_hub_cache(tmp_path / "hf_home" / "hub", "acme/tiny-llama", fake_model)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    version = build_llmapi_repo("acme/tiny-llama", tmp_path / "repo") / "tensorrt_llm" / "1"
    data = yaml.safe_load((version / "model.yaml").read_text())
    assert data["model"] == "acme/tiny-llama"  # written as given: the id travels with the repository
    settings = load_llmapi_settings(version)
    assert Path(settings.engine.model) == snapshot and Path(settings.tokenizer_dir) == snapshot
    (version / "model.yaml").write_text(yaml.safe_dump({**data, "model": "acme/not-cached"}))
    with pytest.raises(ConfigError, match="model 'acme/not-cached' is neither a folder.*HF_HUB_OFFLINE is set"):
        load_llmapi_settings(version)
    with pytest.raises(RepoError, match="model 'acme/other' is neither a folder"):
        build_llmapi_repo("acme/other", tmp_path / "repo2")
