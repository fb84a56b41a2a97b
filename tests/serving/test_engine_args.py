"""load_tensorrt_llm_settings: model.yaml + config.pbtxt parameters -> typed engine and Triton settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tritonllm.deploy.repo import build_repo
from tritonllm.engine.config import ConfigError
from tritonllm.triton.engine_args import KNOWN_PARAMETERS, TensorrtLLMSettings, load_tensorrt_llm_settings
from tritonllm.triton.params import ParameterError

MODEL = "/models/tiny"


def triton_config(params: dict[str, str], *, decoupled=True, max_batch_size=8, max_queue_size=None) -> dict:
    """A model config shaped like the dict Triton hands initialize() (json.loads(args["model_config"]))."""
    config = {
        "name": "tensorrt_llm",
        "max_batch_size": max_batch_size,
        "model_transaction_policy": {"decoupled": decoupled},
        "dynamic_batching": {"preferred_batch_size": [max_batch_size], "max_queue_delay_microseconds": 0},
        "parameters": {key: {"string_value": value} for key, value in params.items()},
    }
    if max_queue_size is not None:
        config["dynamic_batching"]["default_queue_policy"] = {"max_queue_size": max_queue_size}
    return config


@pytest.fixture(autouse=True)
def no_config_path_env(monkeypatch):
    monkeypatch.delenv("LLM_CONFIG_PATH", raising=False)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    (tmp_path / "1").mkdir()
    return tmp_path


def write_yaml(model_dir: Path, data: dict, name="model.yaml") -> Path:
    path = model_dir / "1" / name
    path.write_text(yaml.safe_dump(data))
    return path


def load(model_dir: Path, **params) -> TensorrtLLMSettings:
    return load_tensorrt_llm_settings(triton_config({"gpt_model_path": MODEL, **params}), model_dir)


# ------------------------------------------------------------------------------------------------ defaults


def test_defaults_with_only_the_model(model_dir):
    settings = load(model_dir)
    engine = settings.engine
    assert engine.model == MODEL and engine.tokenizer is None and engine.engine == "auto"
    assert engine.kv_cache_config.enable_block_reuse is True, "enable_kv_cache_reuse defaults to true"
    assert engine.max_batch_size == 8, "unset max_batch_size follows the pbtxt's max_batch_size"
    assert engine.enable_chunked_prefill is False and engine.normalize_log_probs is True
    assert engine.scheduler_config.capacity_scheduler_policy == "GUARANTEED_NO_EVICT"
    assert settings.decoupled is True and settings.exclude_input_in_output is False
    assert (settings.cancellation_check_period_ms, settings.stats_check_period_ms) == (100, 100)
    assert settings.max_queue_size == 0 and settings.triton_max_batch_size == 8
    assert settings.engine_args_path is None and settings.unknown_parameters == ()


def test_settings_are_frozen(model_dir):
    with pytest.raises(dataclasses.FrozenInstanceError):
        load(model_dir).decoupled = False


@pytest.mark.parametrize("unset", ["", "  ", "${max_beam_width}"])
def test_empty_and_unfilled_parameters_are_unset(model_dir, unset):
    names = (
        "max_beam_width",
        "enable_kv_cache_reuse",
        "kv_cache_free_gpu_mem_fraction",
        "batch_scheduler_policy",
        "exclude_input_in_output",
        "cancellation_check_period_ms",
        "engine",
        "lora_prefetch_dir",
        "guided_decoding_backend",
        "decoding_mode",
        "enable_trt_overlap",
        "max_attention_window_size",
    )
    settings = load(model_dir, **{name: unset for name in names})
    assert settings == load(model_dir)


def test_an_unfilled_model_path_is_an_error_naming_it(model_dir):
    with pytest.raises(ParameterError, match="gpt_model_path"):
        load_tensorrt_llm_settings(triton_config({"gpt_model_path": "${engine_dir}"}), model_dir)


# ------------------------------------------------------------------------------------------------ mapping


def test_parameters_map_onto_llm_arguments(model_dir):
    settings = load(
        model_dir,
        tokenizer_dir="/tok",
        max_beam_width="1",
        max_tokens_in_paged_kv_cache="4096",
        kv_cache_free_gpu_mem_fraction="0.5",
        enable_kv_cache_reuse="false",
        enable_chunked_context="true",
        batch_scheduler_policy="max_utilization",
        normalize_log_probs="0",
        engine="embedded",
        dtype="float32",
        device="cpu",
        max_num_tokens="512",
        max_seq_len="1024",
        max_batch_size="32",
        exclude_input_in_output="yes",
        cancellation_check_period_ms="20",
        stats_check_period_ms="50",
    )
    engine = settings.engine
    assert (engine.model, engine.tokenizer, engine.engine, engine.dtype, engine.device) == (
        MODEL,
        "/tok",
        "embedded",
        "float32",
        "cpu",
    )
    assert (engine.max_num_tokens, engine.max_seq_len, engine.max_batch_size, engine.max_beam_width) == (
        512,
        1024,
        32,
        1,
    )
    assert engine.kv_cache_config.max_tokens == 4096 and engine.kv_cache_config.free_gpu_memory_fraction == 0.5
    assert engine.kv_cache_config.enable_block_reuse is False
    assert engine.enable_chunked_prefill is True and engine.normalize_log_probs is False
    assert engine.scheduler_config.capacity_scheduler_policy == "MAX_UTILIZATION"
    assert settings.exclude_input_in_output is True
    assert (settings.cancellation_check_period_ms, settings.stats_check_period_ms) == (20, 50)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1", True),
        ("true", True),
        ("True", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("FALSE", False),
        ("no", False),
    ],
)
def test_bool_spellings(model_dir, text, expected):
    assert load(model_dir, enable_kv_cache_reuse=text).engine.kv_cache_config.enable_block_reuse is expected


def test_triton_side_settings_come_from_the_model_config(model_dir):
    config = triton_config({"gpt_model_path": MODEL}, decoupled=False, max_batch_size=4, max_queue_size="16")
    settings = load_tensorrt_llm_settings(config, model_dir)
    assert settings.decoupled is False and settings.max_queue_size == 16 and settings.engine.max_batch_size == 4
    del config["model_transaction_policy"]
    assert load_tensorrt_llm_settings(config, model_dir).decoupled is False


def test_unknown_parameters_are_reported_not_fatal(model_dir):
    assert load(model_dir, tokenizer_type="sp", my_knob="1").unknown_parameters == ("my_knob", "tokenizer_type")


# ------------------------------------------------------------------------------------------------ model.yaml


def test_yaml_gives_engine_arguments_and_parameters_override_them(model_dir):
    path = write_yaml(
        model_dir,
        {
            "model": "/from/yaml",
            "max_num_tokens": 1024,
            "max_batch_size": 16,
            "kv_cache_config": {"tokens_per_block": 64, "enable_block_reuse": False},
            "triton_config": {"decoupled": True},
        },
    )
    settings = load(model_dir, max_tokens_in_paged_kv_cache="2048")
    engine = settings.engine
    assert settings.engine_args_path == path
    assert engine.model == MODEL, "gpt_model_path overrides the yaml's model"
    assert engine.max_num_tokens == 1024 and engine.max_batch_size == 16, "yaml values stand when not overridden"
    assert (engine.kv_cache_config.tokens_per_block, engine.kv_cache_config.max_tokens) == (64, 2048)
    assert engine.kv_cache_config.enable_block_reuse is False
    assert load(model_dir, max_batch_size="2").engine.max_batch_size == 2


def test_yaml_model_is_used_when_gpt_model_path_is_unset(model_dir):
    write_yaml(model_dir, {"model": "/from/yaml"})
    assert load_tensorrt_llm_settings(triton_config({"gpt_model_path": ""}), model_dir).engine.model == "/from/yaml"


def test_llm_config_path_picks_another_file(model_dir, monkeypatch):
    write_yaml(model_dir, {"max_num_tokens": 100}, name="other.yaml")
    monkeypatch.setenv("LLM_CONFIG_PATH", "other.yaml")
    assert load(model_dir).engine.max_num_tokens == 100
    monkeypatch.setenv("LLM_CONFIG_PATH", str(model_dir / "missing.yaml"))
    with pytest.raises(ConfigError, match="LLM_CONFIG_PATH"):
        load(model_dir)


def test_triton_config_must_agree_with_config_pbtxt(model_dir):
    write_yaml(model_dir, {"triton_config": {"decoupled": False, "max_batch_size": 8}})
    with pytest.raises(ConfigError, match="triton_config.decoupled"):
        load(model_dir)
    write_yaml(model_dir, {"triton_config": {"batching": True}})
    with pytest.raises(ConfigError, match="unknown key"):
        load(model_dir)


def test_bad_yaml_values_name_the_key(model_dir):
    write_yaml(model_dir, {"kv_cache_config": {"tokens_per_blok": 4}})
    with pytest.raises(ConfigError, match="tokens_per_blok"):
        load(model_dir)


def test_the_shipped_template_loads_after_build(tmp_path, monkeypatch):
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    text_format = pytest.importorskip("google.protobuf.text_format")
    json_format = pytest.importorskip("google.protobuf.json_format")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    repo = build_repo(model, tmp_path / "repo", streaming=False, max_batch_size=4, engine="embedded")
    parsed = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), pb2.ModelConfig())
    config = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
    settings = load_tensorrt_llm_settings(config, repo / "tensorrt_llm")
    assert settings.engine.model == settings.engine.tokenizer == str(model.resolve())
    assert settings.engine.engine == "embedded" and settings.engine.max_batch_size == 4
    assert settings.decoupled is False and settings.max_queue_size == 0
    assert settings.engine_args_path == repo / "tensorrt_llm" / "1" / "model.yaml"
    assert set(config["parameters"]) <= KNOWN_PARAMETERS, "every template parameter is known"


# ------------------------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_beam_width", "abc"),
        ("max_beam_width", "0"),
        ("max_tokens_in_paged_kv_cache", "0"),
        ("max_tokens_in_paged_kv_cache", "lots"),
        ("kv_cache_free_gpu_mem_fraction", "1.5"),
        ("kv_cache_free_gpu_mem_fraction", "0"),
        ("kv_cache_free_gpu_mem_fraction", "half"),
        ("enable_kv_cache_reuse", "maybe"),
        ("enable_chunked_context", "sure"),
        ("normalize_log_probs", "2"),
        ("exclude_input_in_output", "nope"),
        ("batch_scheduler_policy", "fifo"),
        ("engine", "vllm"),
        ("dtype", "int8"),
        ("device", "tpu"),
        ("max_num_tokens", "0"),
        ("max_seq_len", "1"),
        ("max_batch_size", "-1"),
        ("max_batch_size", "8.5"),
        ("cancellation_check_period_ms", "0"),
        ("stats_check_period_ms", "often"),
        ("gpt_model_type", "dynamic"),
        ("decoding_mode", "greedy"),
        ("multi_block_mode", "x"),
        ("cuda_graph_mode", "x"),
        ("enable_context_fmha_fp32_acc", "x"),
        ("kv_cache_onboard_blocks", "x"),
        ("cuda_graph_cache_size", "-1"),
        ("iter_stats_max_iterations", "x"),
        ("request_stats_max_iterations", "-5"),
        ("lora_cache_optimal_adapter_size", "x"),
        ("lora_cache_max_adapter_size", "-1"),
        ("lora_cache_host_memory_bytes", "1GB"),
        ("lora_cache_gpu_memory_fraction", "2"),
        ("cross_kv_cache_fraction", "-0.1"),
        ("gpu_device_ids", "gpu0"),
        ("kv_cache_host_memory_bytes", "x"),
        ("num_nodes", "0"),
        ("enable_trt_overlap", "perhaps"),
    ],
)
def test_bad_values_name_the_parameter(model_dir, name, value):
    with pytest.raises(ParameterError, match=f"'{name}'"):
        load(model_dir, **{name: value})


@pytest.mark.parametrize(
    "name, value, why",
    [
        ("decoding_mode", "redrafter", "not supported"),
        ("enable_trt_overlap", "true", "deprecated"),
        ("enable_trt_overlap", "1", "deprecated"),
        ("gpt_model_type", "V1", "static"),
        ("encoder_model_path", "/enc", "encoder-decoder"),
        ("participant_ids", "0", "not supported"),
        ("worker_path", "/bin/worker", "deprecated"),
        ("kv_cache_host_memory_bytes", "1000000", "host memory"),
        ("sink_token_length", "4", "attention sinks"),
        ("num_nodes", "2", "multi-node"),
        ("gpu_weights_percent", "0.5", "weight streaming"),
        ("speculative_decoding_fast_logits", "true", "fast logits"),
    ],
)
def test_unbuilt_features_fail_with_a_clear_error(model_dir, name, value, why):
    with pytest.raises(ParameterError, match=f"'{name}'.*{why}"):
        load(model_dir, **{name: value})


@pytest.mark.parametrize(
    "value, windows", [("1024", [1024]), ("512,1024", [512, 1024]), ("4096, 16 ,16", [4096, 16, 16])]
)
def test_max_attention_window_size_becomes_the_per_layer_windows(model_dir, value, windows):
    """One window, or TensorRT-LLM's backend's comma-separated list (repeated over the layers by the engine)."""
    assert load(model_dir, max_attention_window_size=value).engine.kv_cache_config.max_attention_window == windows


def test_max_attention_window_size_overrides_model_yaml(model_dir):
    write_yaml(model_dir, {"model": MODEL, "kv_cache_config": {"max_attention_window": [8], "tokens_per_block": 16}})
    kv = load(model_dir, max_attention_window_size="32,64").engine.kv_cache_config
    assert (kv.max_attention_window, kv.tokens_per_block) == ([32, 64], 16)
    assert load(model_dir).engine.kv_cache_config.max_attention_window == [8]


@pytest.mark.parametrize("value, why", [("0", ">= 1"), ("-16", ">= 1"), ("16,", "integers"), ("1.5", "integers")])
def test_bad_max_attention_window_size_names_the_parameter(model_dir, value, why):
    with pytest.raises(ParameterError, match=f"'max_attention_window_size'.*{why}"):
        load(model_dir, max_attention_window_size=value)


def test_harmless_contract_parameters_are_accepted(model_dir):
    harmless = {
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
        "multi_block_mode": "true",
        "cuda_graph_mode": "false",
        "cuda_graph_cache_size": "0",
        "enable_context_fmha_fp32_acc": "false",
        "gpu_device_ids": "0,1",
        "kv_cache_onboard_blocks": "true",
        "iter_stats_max_iterations": "1000",
        "request_stats_max_iterations": "0",
        "lora_cache_optimal_adapter_size": "8",
        "lora_cache_max_adapter_size": "64",
        "lora_cache_gpu_memory_fraction": "0.05",
        "lora_cache_host_memory_bytes": "1073741824",
        "decoding_mode": "top_k_top_p",
        "enable_trt_overlap": "false",
        "kv_cache_host_memory_bytes": "0",
        "sink_token_length": "0",
        "num_nodes": "1",
        "gpu_weights_percent": "1.0",
        "cross_kv_cache_fraction": "0.5",
        "speculative_decoding_fast_logits": "false",
        "medusa_choices": "{0, 0}",
        "lookahead_window_size": "4",
        "xgrammar_tokenizer_info_path": "/x.json",
    }
    settings = load(model_dir, **harmless)
    assert settings.engine.model == MODEL and settings.unknown_parameters == ()
    assert load(model_dir, gpt_model_type="inflight_batching", decoding_mode="AUTO").engine.model == MODEL


# ------------------------------------------------------------------------------------------------ speculative


def test_lookahead_decoding_mode_becomes_speculative_config(model_dir):
    settings = load(
        model_dir,
        decoding_mode="lookahead",
        lookahead_window_size="3",
        lookahead_ngram_size="4",
        lookahead_verification_set_size="2",
    )
    assert settings.engine.speculative_config == {
        "decoding_type": "Lookahead",
        "max_window_size": 3,
        "max_ngram_size": 4,
        "max_verification_set_size": 2,
    }
    spec = settings.engine.speculative_settings()
    assert (spec.max_window_size, spec.max_ngram_size, spec.max_verification_set_size) == (3, 4, 2)


def test_lookahead_decoding_mode_needs_all_three_sizes(model_dir):
    with pytest.raises(ParameterError, match="'lookahead_ngram_size' is required with decoding_mode=lookahead"):
        load(model_dir, decoding_mode="lookahead", lookahead_window_size="3", lookahead_verification_set_size="2")


@pytest.mark.parametrize("mode", ["medusa", "eagle"])
def test_medusa_and_eagle_decoding_modes_take_their_choices_and_the_folder_from_model_yaml(model_dir, mode):
    kind = mode.capitalize()
    write_yaml(model_dir, {"speculative_config": {"decoding_type": kind, "speculative_model_dir": "/heads"}})
    settings = load(model_dir, decoding_mode=mode, **{f"{mode}_choices": "{0}, {0, 0}, {1}"})
    assert settings.engine.speculative_config == {
        "decoding_type": kind,
        "speculative_model_dir": "/heads",
        f"{mode}_choices": "{0}, {0, 0}, {1}",
    }
    assert settings.engine.speculative_settings().max_total_draft_tokens == 3
    with pytest.raises(ConfigError, match="speculative_model_dir"):
        load(_empty(model_dir), decoding_mode=mode)  # no speculative_config in model.yaml: no heads / layer


def _empty(model_dir: Path) -> Path:
    other = model_dir / "no_yaml"
    (other / "1").mkdir(parents=True)
    return other


def test_attention_backend_and_overlap_scheduler_parameters_reach_the_engine(model_dir):
    engine = load(model_dir, attn_backend="vanilla", disable_overlap_scheduler="true").engine
    assert (engine.attn_backend, engine.disable_overlap_scheduler) == ("VANILLA", True)
    assert (load(model_dir).engine.attn_backend, load(model_dir).engine.disable_overlap_scheduler) == ("TRTLLM", False)
    with pytest.raises(Exception, match="attn_backend"):
        load(model_dir, attn_backend="FAST")


def test_cuda_graph_mode_switches_graphs_keeping_model_yaml_settings(model_dir):
    assert load(model_dir).engine.cuda_graph_config == {}  # unset: the engine's default graphs
    assert load(model_dir, cuda_graph_mode="false").engine.cuda_graph_config is None
    write_yaml(model_dir, {"cuda_graph_config": {"batch_sizes": [1, 4]}})
    assert load(model_dir, cuda_graph_mode="true").engine.cuda_graph_config == {"batch_sizes": [1, 4]}
    write_yaml(model_dir, {"cuda_graph_config": None})
    assert load(model_dir).engine.cuda_graph_config is None
    assert load(model_dir, cuda_graph_mode="true").engine.cuda_graph_config == {}
    with pytest.raises(ParameterError, match="cuda_graph_mode"):
        load(model_dir, cuda_graph_mode="sometimes")
