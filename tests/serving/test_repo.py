"""The model-repository template against the interface contract, and build_repo / fill_template / validate_repo."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tritonllm.deploy.repo import (
    MODEL_NAMES,
    RepoError,
    build_repo,
    fill_template,
    parse_substitutions,
    placeholders,
    structural_placeholders,
    template_dir,
    validate_repo,
)

text_format = pytest.importorskip("google.protobuf.text_format")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")

# ------------------------------------------------------------------------------------------------ the contract
# name: (data_type, dims, optional, reshape to [], allow_ragged_batch). Written from interface-contract.md §1,
# independently of the template, so a typo in either shows up here.
REQ, OPT = False, True


def inputs(*rows):
    return {row[0]: tuple(row[1:]) for row in rows}


def scalar_opts(dtype, *names, reshape=False):
    return [(name, dtype, [1], OPT, reshape, False) for name in names]


PREPROCESSING_INPUTS = inputs(
    ("QUERY", "TYPE_STRING", [1], REQ, False, False),
    ("DECODER_QUERY", "TYPE_STRING", [1], OPT, False, False),
    ("IMAGE_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], OPT, False, False),
    ("IMAGE_URL", "TYPE_STRING", [1], OPT, False, False),
    ("VIDEO_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], OPT, False, False),
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1], REQ, False, False),
    ("BAD_WORDS_DICT", "TYPE_STRING", [-1], OPT, False, False),
    ("STOP_WORDS_DICT", "TYPE_STRING", [-1], OPT, False, False),
    ("EMBEDDING_BIAS_WORDS", "TYPE_STRING", [-1], OPT, False, False),
    ("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", [-1], OPT, False, False),
    ("END_ID", "TYPE_INT32", [1], OPT, False, False),
    ("PAD_ID", "TYPE_INT32", [1], OPT, False, False),
    ("PROMPT_TABLE_EXTRA_ID", "TYPE_UINT64", [1], OPT, False, False),
)
PREPROCESSING_OUTPUTS = {
    "INPUT_ID": ("TYPE_INT32", [-1]),
    "REQUEST_INPUT_LEN": ("TYPE_INT32", [1]),
    "DECODER_INPUT_ID": ("TYPE_INT32", [-1]),
    "REQUEST_DECODER_INPUT_LEN": ("TYPE_INT32", [1]),
    "BAD_WORDS_IDS": ("TYPE_INT32", [2, -1]),
    "STOP_WORDS_IDS": ("TYPE_INT32", [2, -1]),
    "EMBEDDING_BIAS": ("TYPE_FP32", [-1]),
    "REQUEST_OUTPUT_LEN": ("TYPE_INT32", [-1]),
    "OUT_END_ID": ("TYPE_INT32", [1]),
    "OUT_PAD_ID": ("TYPE_INT32", [1]),
    "OUT_PROMPT_TABLE_EXTRA_IDS": ("TYPE_UINT64", [-1]),
    "PIXEL_VALUES": ("TYPE_FP16", [-1, -1, -1, -1]),
    "ASPECT_RATIO_IDS": ("TYPE_INT64", [-1]),
    "ASPECT_RATIO_MASK": ("TYPE_INT64", [-1, -1]),
    "CROSS_ATTENTION_MASK": ("TYPE_INT64", [-1, -1, -1]),
    "IMAGE_SIZES": ("TYPE_INT64", [2]),
    "IS_VIDEO_INPUT": ("TYPE_BOOL", [1]),
    "ATTENTION_MASK": ("TYPE_INT64", [-1]),
    "IMAGE_GRID_THW": ("TYPE_INT64", [3]),
    "VISION_INPUT_ID": ("TYPE_INT32", [-1]),
}
RAGGED = lambda name, dtype, dims: (name, dtype, dims, OPT, False, True)  # noqa: E731
TENSORRT_LLM_INPUTS = inputs(
    RAGGED("input_ids", "TYPE_INT32", [-1]),
    RAGGED("encoder_input_features", "TYPE_FP16", [-1, -1]),  # ${encoder_input_features_data_type}, built FP16
    ("encoder_output_lengths", "TYPE_INT32", [1], OPT, True, False),
    ("input_lengths", "TYPE_INT32", [1], REQ, True, False),
    ("request_output_len", "TYPE_INT32", [1], REQ, True, False),
    ("num_return_sequences", "TYPE_INT32", [1], OPT, True, False),
    RAGGED("draft_input_ids", "TYPE_INT32", [-1]),
    RAGGED("decoder_input_ids", "TYPE_INT32", [-1]),
    ("decoder_input_lengths", "TYPE_INT32", [1], OPT, True, False),
    RAGGED("draft_logits", "TYPE_FP32", [-1, -1]),  # ${logits_datatype}
    ("draft_acceptance_threshold", "TYPE_FP32", [1], OPT, True, False),
    *scalar_opts(
        "TYPE_INT32",
        "end_id",
        "pad_id",
        "beam_width",
        "runtime_top_k",
        "runtime_top_p_reset_ids",
        "min_tokens",
        "min_length",
        "prompt_vocab_size",
        reshape=True,
    ),
    RAGGED("stop_words_list", "TYPE_INT32", [2, -1]),
    RAGGED("bad_words_list", "TYPE_INT32", [2, -1]),
    RAGGED("embedding_bias", "TYPE_FP32", [-1]),
    *scalar_opts(
        "TYPE_FP32",
        "temperature",
        "runtime_top_p",
        "runtime_top_p_min",
        "runtime_top_p_decay",
        "len_penalty",
        "repetition_penalty",
        "beam_search_diversity_rate",
        "presence_penalty",
        "frequency_penalty",
        "priority",
        reshape=True,
    ),
    *scalar_opts(
        "TYPE_BOOL",
        "early_stopping",
        "return_log_probs",
        "return_context_logits",
        "return_generation_logits",
        "return_perf_metrics",
        "exclude_input_in_output",
        "stop",
        "streaming",
        reshape=True,
    ),
    *scalar_opts("TYPE_UINT64", "seed", "lora_task_id", reshape=True),
    *scalar_opts(
        "TYPE_STRING", "lora_name"
    ),  # ours; no reshape: Triton 2.51 garbles a reshaped STRING from an ensemble
    RAGGED("prompt_embedding_table", "TYPE_FP16", [-1, -1]),
    RAGGED("prompt_table_extra_ids", "TYPE_UINT64", [-1]),
    RAGGED("cross_attention_mask", "TYPE_BOOL", [-1, -1]),
    ("mrope_rotary_cos_sin", "TYPE_FP32", [-1], OPT, False, False),
    ("mrope_position_deltas", "TYPE_INT64", [1], OPT, False, False),
    RAGGED("lora_weights", "TYPE_FP16", [-1, -1]),
    RAGGED("lora_config", "TYPE_INT32", [-1, 3]),
    RAGGED("context_phase_params", "TYPE_UINT8", [-1]),
    RAGGED("skip_cross_attn_blocks", "TYPE_BOOL", [1]),
    *[
        RAGGED(f"retention_token_range_{part}", "TYPE_INT32", [-1])
        for part in ("starts", "ends", "priorities", "durations_ms")
    ],
    RAGGED("retention_decode_priority", "TYPE_INT32", [1]),
    RAGGED("retention_decode_duration_ms", "TYPE_INT32", [1]),
    RAGGED("guided_decoding_guide_type", "TYPE_STRING", [1]),
    RAGGED("guided_decoding_guide", "TYPE_STRING", [1]),
    RAGGED("guided_decoding_prefix_len", "TYPE_INT32", [1]),  # ours: the BLS draft/target loop continues a guide
    *[
        RAGGED(f"lookahead_{part}", "TYPE_INT32", [1])
        for part in ("window_size", "ngram_size", "verification_set_size")
    ],
)
PERF_METRICS = {
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", [1]),
    "kv_cache_reused_blocks": ("TYPE_INT32", [1]),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", [1]),
    "arrival_time_ns": ("TYPE_INT64", [1]),
    "first_scheduled_time_ns": ("TYPE_INT64", [1]),
    "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]),
    "acceptance_rate": ("TYPE_FP32", [1]),
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}
COMMON_OUTPUTS = {
    "cum_log_probs": ("TYPE_FP32", [-1]),
    "output_log_probs": ("TYPE_FP32", [-1, -1]),
    "context_logits": ("TYPE_FP32", [-1, -1]),
    "generation_logits": ("TYPE_FP32", [-1, -1, -1]),
    "batch_index": ("TYPE_INT32", [1]),
    "sequence_index": ("TYPE_INT32", [1]),
    **PERF_METRICS,
}
TENSORRT_LLM_OUTPUTS = {
    "output_ids": ("TYPE_INT32", [-1, -1]),
    "sequence_length": ("TYPE_INT32", [-1]),
    "context_phase_params": ("TYPE_UINT8", [-1]),
    **COMMON_OUTPUTS,
    # our additions for streaming detokenization
    "detok_prefix_ids": ("TYPE_INT32", [-1, -1]),
    "detok_is_final": ("TYPE_BOOL", [1]),
    "cancel_key": ("TYPE_STRING", [1]),  # ours: stops a cancelled ensemble stream's generation
}
POSTPROCESSING_INPUTS = inputs(
    ("TOKENS_BATCH", "TYPE_INT32", [-1, -1], REQ, False, False),
    ("SEQUENCE_LENGTH", "TYPE_INT32", [-1], REQ, False, False),
    ("PREFIX_IDS", "TYPE_INT32", [-1, -1], OPT, False, False),  # ours
    ("IS_FINAL", "TYPE_BOOL", [1], OPT, False, False),  # ours
    ("CANCEL_KEY", "TYPE_STRING", [1], OPT, False, False),  # ours
)
ENSEMBLE_INPUTS = inputs(
    ("text_input", "TYPE_STRING", [1], REQ, False, False),
    ("max_tokens", "TYPE_INT32", [1], REQ, False, False),
    *scalar_opts("TYPE_STRING", "decoder_text_input"),
    *scalar_opts(
        "TYPE_INT32",
        "num_return_sequences",
        "end_id",
        "pad_id",
        "top_k",
        "min_tokens",
        "min_length",
        "beam_width",
        "prompt_vocab_size",
    ),
    *scalar_opts(
        "TYPE_FP32",
        "top_p",
        "temperature",
        "length_penalty",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ),
    *scalar_opts(
        "TYPE_BOOL",
        "exclude_input_in_output",
        "return_log_probs",
        "return_context_logits",
        "return_generation_logits",
        "return_perf_metrics",
        "stream",
    ),
    *scalar_opts("TYPE_UINT64", "seed", "prompt_table_extra_id", "lora_task_id"),
    *scalar_opts("TYPE_STRING", "lora_name"),  # ours
    *scalar_opts("TYPE_FP32", "priority"),  # ours
    *[(name, "TYPE_STRING", [-1], OPT, False, False) for name in ("bad_words", "stop_words", "embedding_bias_words")],
    ("embedding_bias_weights", "TYPE_FP32", [-1], OPT, False, False),
    ("prompt_embedding_table", "TYPE_FP16", [-1, -1], OPT, False, False),
    RAGGED("lora_weights", "TYPE_FP16", [-1, -1]),
    RAGGED("lora_config", "TYPE_INT32", [-1, 3]),
    RAGGED("guided_decoding_guide_type", "TYPE_STRING", [1]),
    RAGGED("guided_decoding_guide", "TYPE_STRING", [1]),
)
BLS_INPUTS = inputs(
    ("text_input", "TYPE_STRING", [1], REQ, False, False),
    ("max_tokens", "TYPE_INT32", [1], REQ, False, False),
    *scalar_opts(
        "TYPE_STRING", "decoder_text_input", "image_url_input", "guided_decoding_guide_type", "guided_decoding_guide"
    ),
    ("image_input", "TYPE_FP16", [-1, 3, -1, -1], OPT, False, False),
    ("image_bytes_input", "TYPE_UINT8", [-1, -1, -1, -1], OPT, False, False),
    ("video_bytes_input", "TYPE_UINT8", [-1, -1, -1, -1], OPT, False, False),
    *scalar_opts(
        "TYPE_INT32",
        "end_id",
        "pad_id",
        "top_k",
        "min_tokens",
        "min_length",
        "beam_width",
        "prompt_vocab_size",
        "num_draft_tokens",
    ),
    *scalar_opts(
        "TYPE_FP32",
        "top_p",
        "temperature",
        "length_penalty",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ),
    *scalar_opts("TYPE_BOOL", "exclude_input_in_output", "stream"),
    *scalar_opts(
        "TYPE_BOOL",
        "return_log_probs",
        "return_context_logits",
        "return_generation_logits",
        "use_draft_logits",
        "return_perf_metrics",
        reshape=True,
    ),
    *scalar_opts("TYPE_INT32", "num_return_sequences", reshape=True),
    *scalar_opts("TYPE_UINT64", "seed", "prompt_table_extra_id"),
    *scalar_opts("TYPE_UINT64", "lora_task_id", reshape=True),
    *scalar_opts("TYPE_STRING", "lora_name", reshape=True),  # ours
    *scalar_opts("TYPE_FP32", "priority", reshape=True),  # ours
    *[(name, "TYPE_STRING", [-1], OPT, False, False) for name in ("bad_words", "stop_words", "embedding_bias_words")],
    ("embedding_bias_weights", "TYPE_FP32", [-1], OPT, False, False),
    ("prompt_embedding_table", "TYPE_FP16", [-1, -1], OPT, False, False),  # ${prompt_embedding_table_data_type}
    RAGGED("lora_weights", "TYPE_FP16", [-1, -1]),
    RAGGED("lora_config", "TYPE_INT32", [-1, 3]),
)
CONTRACT = {
    "preprocessing": (PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS),
    "tensorrt_llm": (TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS),
    "postprocessing": (POSTPROCESSING_INPUTS, {"OUTPUT": ("TYPE_STRING", [-1])}),
    "ensemble": (ENSEMBLE_INPUTS, {"text_output": ("TYPE_STRING", [-1]), **COMMON_OUTPUTS}),
    "tensorrt_llm_bls": (BLS_INPUTS, {"text_output": ("TYPE_STRING", [-1]), **COMMON_OUTPUTS}),
}
# Every placeholder TensorRT-LLM's templates have, so fill_template command lines written for them still work.
ANCHOR_PLACEHOLDERS = {
    "preprocessing": {
        "triton_max_batch_size",
        "max_queue_delay_microseconds",
        "max_queue_size",
        "tokenizer_dir",
        "add_special_tokens",
        "multimodal_model_path",
        "engine_dir",
        "max_num_images",
        "preprocessing_instance_count",
    },
    "postprocessing": {
        "triton_max_batch_size",
        "tokenizer_dir",
        "skip_special_tokens",
        "postprocessing_instance_count",
    },
    "ensemble": {"triton_max_batch_size", "logits_datatype"},
    "tensorrt_llm_bls": {
        "triton_max_batch_size",
        "decoupled_mode",
        "bls_instance_count",
        "accumulate_tokens",
        "tensorrt_llm_model_name",
        "tensorrt_llm_draft_model_name",
        "multimodal_encoders_name",
        "logits_datatype",
        "prompt_embedding_table_data_type",
    },
    "tensorrt_llm": {
        "triton_backend",
        "triton_max_batch_size",
        "decoupled_mode",
        "max_queue_delay_microseconds",
        "max_queue_size",
        "encoder_input_features_data_type",
        "logits_datatype",
        "max_beam_width",
        "batching_strategy",
        "engine_dir",
        "encoder_engine_dir",
        "max_tokens_in_paged_kv_cache",
        "max_attention_window_size",
        "sink_token_length",
        "batch_scheduler_policy",
        "kv_cache_free_gpu_mem_fraction",
        "cross_kv_cache_fraction",
        "kv_cache_host_memory_bytes",
        "kv_cache_onboard_blocks",
        "enable_trt_overlap",
        "exclude_input_in_output",
        "cancellation_check_period_ms",
        "stats_check_period_ms",
        "iter_stats_max_iterations",
        "request_stats_max_iterations",
        "enable_kv_cache_reuse",
        "normalize_log_probs",
        "enable_chunked_context",
        "gpu_device_ids",
        "participant_ids",
        "num_nodes",
        "lora_cache_optimal_adapter_size",
        "lora_cache_max_adapter_size",
        "lora_cache_gpu_memory_fraction",
        "lora_cache_host_memory_bytes",
        "lora_prefetch_dir",
        "decoding_mode",
        "lookahead_window_size",
        "lookahead_ngram_size",
        "lookahead_verification_set_size",
        "medusa_choices",
        "eagle_choices",
        "gpu_weights_percent",
        "enable_context_fmha_fp32_acc",
        "multi_block_mode",
        "cuda_graph_mode",
        "cuda_graph_cache_size",
        "speculative_decoding_fast_logits",
        "tokenizer_dir",
        "guided_decoding_backend",
        "xgrammar_tokenizer_info_path",
    },
}


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def fake_model(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    return model


@pytest.fixture
def built(fake_model, tmp_path) -> Path:
    return build_repo(fake_model, tmp_path / "repo")


def parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def dtype_name(tensor) -> str:
    return model_config_pb2.DataType.Name(tensor.data_type)


def declared_inputs(config) -> dict:
    return {
        t.name: (
            dtype_name(t),
            list(t.dims),
            t.optional,
            t.HasField("reshape") and list(t.reshape.shape) == [],
            t.allow_ragged_batch,
        )
        for t in config.input
    }


def declared_outputs(config) -> dict:
    return {t.name: (dtype_name(t), list(t.dims)) for t in config.output}


def parameters(config) -> dict:
    return {key: value.string_value for key, value in config.parameters.items()}


# ------------------------------------------------------------------------------------------------ contract


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_contract_input_is_declared_exactly(built, model):
    assert declared_inputs(parse(built / model / "config.pbtxt")) == CONTRACT[model][0]


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_contract_output_is_declared_exactly(built, model):
    assert declared_outputs(parse(built / model / "config.pbtxt")) == CONTRACT[model][1]


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_no_tensor_is_declared_twice(built, model):
    config = parse(built / model / "config.pbtxt")
    for tensors in (config.input, config.output):
        names = [t.name for t in tensors]
        assert len(names) == len(set(names)), names


def test_headers_follow_the_contract(built):
    configs = {name: parse(built / name / "config.pbtxt") for name in MODEL_NAMES}
    assert {name: c.name for name, c in configs.items()} == {name: name for name in MODEL_NAMES}
    assert configs["ensemble"].platform == "ensemble"
    for name in ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"):
        assert configs[name].backend == "python"
        # postprocessing departs from the anchor: its batcher's queue would fail the steps of a cancelled ensemble
        # request, which Triton 2.51 then never completes (docs/faults.md).
        assert configs[name].HasField("dynamic_batching") == (name in ("preprocessing", "tensorrt_llm"))
        assert [g.kind for g in configs[name].instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    assert all(c.max_batch_size == 8 for c in configs.values())
    assert configs["tensorrt_llm"].model_transaction_policy.decoupled is True
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled is True
    assert configs["tensorrt_llm_bls"].instance_group[0].count == 1
    assert list(configs["tensorrt_llm"].dynamic_batching.preferred_batch_size) == [8]


def test_template_keeps_every_anchor_placeholder():
    for model, names in ANCHOR_PLACEHOLDERS.items():
        text = (template_dir() / model / "config.pbtxt").read_text()
        assert names <= placeholders(text), (model, sorted(names - placeholders(text)))


# ------------------------------------------------------------------------------------------------ ensemble wiring


def test_ensemble_wiring_is_consistent(built):
    configs = {name: parse(built / name / "config.pbtxt") for name in MODEL_NAMES}
    ensemble = configs["ensemble"]
    available = {t.name: dtype_name(t) for t in ensemble.input}
    consumed = set()
    for step in ensemble.ensemble_scheduling.step:
        model_inputs = {t.name: dtype_name(t) for t in configs[step.model_name].input}
        model_outputs = {t.name: dtype_name(t) for t in configs[step.model_name].output}
        for key, value in step.input_map.items():
            assert key in model_inputs, (step.model_name, key)
            assert available[value] == model_inputs[key], (step.model_name, key, value)
            consumed.add(value)
        for key, value in step.output_map.items():
            assert key in model_outputs, (step.model_name, key)
            available[value] = model_outputs[key]
    assert {t.name for t in ensemble.input} <= consumed, "an ensemble input reaches no step"
    for tensor in ensemble.output:
        assert available.get(tensor.name) == dtype_name(tensor), tensor.name


def test_ensemble_wires_the_detokenization_tensors_and_min_length(built):
    steps = {s.model_name: s for s in parse(built / "ensemble" / "config.pbtxt").ensemble_scheduling.step}
    trt, post = steps["tensorrt_llm"], steps["postprocessing"]
    assert trt.output_map["detok_prefix_ids"] == "_PREFIX_IDS" and post.input_map["PREFIX_IDS"] == "_PREFIX_IDS"
    assert trt.output_map["detok_is_final"] == "_IS_FINAL" and post.input_map["IS_FINAL"] == "_IS_FINAL"
    assert trt.output_map["cancel_key"] == "_CANCEL_KEY" and post.input_map["CANCEL_KEY"] == "_CANCEL_KEY"
    assert trt.input_map["min_length"] == "min_length"
    assert trt.input_map["runtime_top_k"] == "top_k" and trt.input_map["streaming"] == "stream"
    assert trt.output_map["output_ids"] == "_TOKENS_BATCH" and post.input_map["TOKENS_BATCH"] == "_TOKENS_BATCH"


# ------------------------------------------------------------------------------------------------ build_repo


def test_build_leaves_no_placeholder_and_fills_the_parameters(built, fake_model):
    for path in built.rglob("*"):
        if path.is_file():
            assert "${" not in path.read_text(), path
    trt = parameters(parse(built / "tensorrt_llm" / "config.pbtxt"))
    assert trt["gpt_model_path"] == trt["tokenizer_dir"] == str(fake_model.resolve())
    assert trt["engine"] == "auto" and trt["enable_kv_cache_reuse"] == "true"
    assert trt["lora_prefetch_dir"] == "" and trt["max_batch_size"] == ""
    for name in ("preprocessing", "postprocessing"):
        config = parse(built / name / "config.pbtxt")
        assert parameters(config)["tokenizer_dir"] == str(fake_model.resolve())
        assert config.instance_group[0].count == 1
    assert (built / "ensemble" / "1").is_dir()
    bls = parameters(parse(built / "tensorrt_llm_bls" / "config.pbtxt"))
    assert (bls["accumulate_tokens"], bls["tensorrt_llm_model_name"]) == ("false", "tensorrt_llm")
    assert bls["triton_grpc_url"] == "" and bls["tensorrt_llm_draft_model_name"] == ""
    assert validate_repo(built) == []


def test_build_options_reach_the_configs(fake_model, tmp_path):
    repo = build_repo(
        fake_model,
        tmp_path / "repo",
        streaming=False,
        max_batch_size=4,
        engine="embedded",
        preprocessing_instances=2,
        postprocessing_instances=3,
        dtype="float32",
        device="cpu",
        max_seq_len=512,
        max_num_tokens=256,
        kv_cache_max_tokens=4096,
        parameters={
            "batch_scheduler_policy": "max_utilization",
            "max_batch_size": 16,
            "exclude_input_in_output": True,
            "decoding_mode": None,
            "gpt_model_type": "inflight_batching",
        },
    )
    trt = parse(repo / "tensorrt_llm" / "config.pbtxt")
    assert trt.model_transaction_policy.decoupled is False and trt.max_batch_size == 4
    params = parameters(trt)
    assert (params["engine"], params["dtype"], params["device"]) == ("embedded", "float32", "cpu")
    assert (params["max_seq_len"], params["max_num_tokens"], params["max_tokens_in_paged_kv_cache"]) == (
        "512",
        "256",
        "4096",
    )
    assert params["batch_scheduler_policy"] == "max_utilization" and params["max_batch_size"] == "16"
    assert params["exclude_input_in_output"] == "true" and params["decoding_mode"] == ""
    assert params["gpt_model_type"] == "inflight_batching", "a parameter key reaches its differently named placeholder"
    assert parse(repo / "preprocessing" / "config.pbtxt").instance_group[0].count == 2
    assert parse(repo / "postprocessing" / "config.pbtxt").instance_group[0].count == 3
    assert parse(repo / "tensorrt_llm_bls" / "config.pbtxt").model_transaction_policy.decoupled is False


def test_build_fills_the_bls_parameters(fake_model, tmp_path):
    repo = build_repo(
        fake_model,
        tmp_path / "repo",
        parameters={"bls_instance_count": 4, "accumulate_tokens": True, "triton_grpc_url": "localhost:9001"},
    )
    bls = parse(repo / "tensorrt_llm_bls" / "config.pbtxt")
    assert bls.instance_group[0].count == 4
    assert parameters(bls)["accumulate_tokens"] == "true"
    assert parameters(bls)["triton_grpc_url"] == "localhost:9001"


def test_build_resolves_a_relative_model_folder(fake_model, tmp_path, monkeypatch):
    monkeypatch.chdir(fake_model.parent)
    repo = build_repo(fake_model.name, tmp_path / "repo")
    assert parameters(parse(repo / "postprocessing" / "config.pbtxt"))["tokenizer_dir"] == str(fake_model.resolve())


def test_build_ships_the_model_files(built):
    for name in ("preprocessing", "tensorrt_llm", "postprocessing"):
        assert f"from tritonllm.models.{name} import TritonPythonModel" in (built / name / "1" / "model.py").read_text()
    assert (
        "from tritonllm.models.bls import TritonPythonModel"
        in (built / "tensorrt_llm_bls" / "1" / "model.py").read_text()
    )
    engine_args = yaml.safe_load((built / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert engine_args["engine"] == "auto" and "triton_config" in engine_args and "model" not in engine_args


@pytest.mark.parametrize(
    "broken, message",
    [
        ("config.json", "config.json"),
        ("tokenizer.json", "tokenizer"),
    ],
)
def test_build_rejects_an_incomplete_model_folder(fake_model, tmp_path, broken, message):
    (fake_model / broken).unlink()
    with pytest.raises(RepoError, match=message):
        build_repo(fake_model, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_build_rejects_a_missing_model_folder(tmp_path):
    with pytest.raises(RepoError, match="does not exist"):
        build_repo(tmp_path / "nope", tmp_path / "repo")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"preprocessing_instances": 0}, "preprocessing_instances"),
        ({"postprocessing_instances": -1}, "postprocessing_instances"),
        ({"max_seq_len": 1}, "max_seq_len"),
        ({"max_num_tokens": 0}, "max_num_tokens"),
        ({"kv_cache_max_tokens": 2.5}, "kv_cache_max_tokens"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"engine": "vllm"}, "engine"),
        ({"dtype": "int4"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"kv_cache_free_gpu_mem_fraction": 0.0}, "kv_cache_free_gpu_mem_fraction"),
        ({"parameters": {"no_such_placeholder": 1}}, "no_such_placeholder"),
        ({"parameters": {"gpu_device_ids": 'a"b'}}, "gpu_device_ids"),
    ],
)
def test_build_rejects_bad_options(fake_model, tmp_path, options, message):
    with pytest.raises(RepoError, match=message):
        build_repo(fake_model, tmp_path / "repo", **options)


def test_build_keeps_other_models_and_replaces_ours_only_with_overwrite(fake_model, tmp_path):
    repo = tmp_path / "repo"
    (repo / "my_model").mkdir(parents=True)
    build_repo(fake_model, repo)
    with pytest.raises(RepoError, match="overwrite"):
        build_repo(fake_model, repo, max_batch_size=2)
    assert parse(repo / "ensemble" / "config.pbtxt").max_batch_size == 8
    build_repo(fake_model, repo, max_batch_size=2, overwrite=True)
    assert parse(repo / "ensemble" / "config.pbtxt").max_batch_size == 2
    assert sorted(p.name for p in repo.iterdir()) == sorted(["my_model", *MODEL_NAMES])


def test_template_dir_honours_the_environment(tmp_path, monkeypatch):
    real = template_dir()
    monkeypatch.setenv("TRITONLLM_MODELS_DIR", str(tmp_path))
    with pytest.raises(RepoError, match="TRITONLLM_MODELS_DIR"):
        template_dir()
    shutil.copytree(real, tmp_path / "models")
    monkeypatch.setenv("TRITONLLM_MODELS_DIR", str(tmp_path / "models"))
    assert template_dir() == tmp_path / "models"


# ------------------------------------------------------------------------------------------------ fill_template


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "config.pbtxt"
    path.write_text(
        "max_batch_size: ${triton_max_batch_size}\n"
        "dynamic_batching { max_queue_delay_microseconds: ${max_queue_delay_microseconds}\n"
        "  default_queue_policy { max_queue_size: ${max_queue_size} } }\n"
        'parameters: { key: "gpu_device_ids" value: { string_value: "${gpu_device_ids}" } }\n'
        'parameters: { key: "tokenizer_dir" value: { string_value: "${tokenizer_dir}" } }\n'
    )
    return path


def test_fill_template_substitutes_in_place_and_prefills_the_queue(config_file):
    fill_template(config_file, "triton_max_batch_size:4,gpu_device_ids:0\\,1")
    text = config_file.read_text()
    assert "max_batch_size: 4\n" in text
    assert "microseconds: 0\n" in text and "max_queue_size: 0 }" in text
    assert 'string_value: "0,1"' in text
    assert "${tokenizer_dir}" in text  # not given: left for a later fill


def test_fill_template_given_queue_values_win(config_file):
    text = fill_template(
        config_file, "triton_max_batch_size:1,max_queue_size:32,max_queue_delay_microseconds:100", in_place=False
    )
    assert "microseconds: 100\n" in text and "max_queue_size: 32 }" in text
    assert "${max_queue_size}" in config_file.read_text(), "in_place=False must not write"


def test_fill_template_names_a_missing_key(config_file):
    with pytest.raises(RepoError, match="'decoupled_mode'.*does not exist"):
        fill_template(config_file, "triton_max_batch_size:4,decoupled_mode:true")
    assert "${triton_max_batch_size}" in config_file.read_text(), "a failed fill must not write"


def test_triton_backend_tensorrtllm_is_refused_with_the_value_to_use(config_file, fake_model, tmp_path):
    """The backend's docs fill triton_backend:tensorrtllm; Triton would then fail at load for want of that C++
    backend. Refused at fill and at build, before anything is written."""
    config_file.write_text(config_file.read_text() + 'backend: "${triton_backend}"\n')
    with pytest.raises(RepoError, match="triton_backend 'tensorrtllm'.*use triton_backend:python"):
        fill_template(config_file, "triton_backend:tensorrtllm,triton_max_batch_size:4")
    assert "${triton_backend}" in config_file.read_text()
    filled = fill_template(config_file, "triton_backend:python,triton_max_batch_size:4", in_place=False)
    assert 'backend: "python"' in filled
    with pytest.raises(RepoError, match="use triton_backend:python"):
        build_repo(fake_model, tmp_path / "repo", parameters={"triton_backend": "tensorrtllm"})
    assert not (tmp_path / "repo" / "tensorrt_llm").exists()


def test_the_bls_filled_as_the_backends_docs_fill_it_has_no_structural_placeholder_left(tmp_path):
    """docs/llama.md of the backend fills the BLS with these keys alone; the prompt table's data_type then takes
    its default instead of staying a placeholder Triton cannot parse."""
    import shutil

    target = tmp_path / "tensorrt_llm_bls"
    shutil.copytree(template_dir() / "tensorrt_llm_bls", target)
    fill_template(
        target / "config.pbtxt",
        "triton_max_batch_size:64,decoupled_mode:False,bls_instance_count:1,"
        "accumulate_tokens:False,logits_datatype:TYPE_FP32",
    )
    text = (target / "config.pbtxt").read_text()
    assert 'name: "prompt_embedding_table" data_type: TYPE_FP16' in text
    assert not structural_placeholders(text), structural_placeholders(text)


def test_fill_template_accepts_a_mapping(config_file):
    assert "max_batch_size: 2" in fill_template(config_file, {"triton_max_batch_size": "2"}, in_place=False)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a:1,b:2", {"a": "1", "b": "2"}),
        ("ids:0\\,1\\,2", {"ids": "0,1,2"}),
        ("path:C\\:/models,x:", {"path": "C:/models", "x": ""}),
        ("url:http://host:80/x", {"url": "http://host:80/x"}),
        ("a:1,,b:2,", {"a": "1", "b": "2"}),
        ("back:a\\\\b", {"back": "a\\b"}),
    ],
)
def test_parse_substitutions(text, expected):
    assert parse_substitutions(text) == expected


@pytest.mark.parametrize("text", ["novalue", ":1", "a:1,oops"])
def test_parse_substitutions_rejects_pairs_without_a_key(text):
    with pytest.raises(RepoError, match="key:value"):
        parse_substitutions(text)


# ------------------------------------------------------------------------------------------------ validate_repo


def test_validate_repo_lists_unfilled_structural_placeholders(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(template_dir(), repo)
    errors = "\n".join(validate_repo(repo))
    for expected in (
        "tensorrt_llm/config.pbtxt",
        "max_batch_size holds the unfilled placeholder ${triton_max_batch_size}",
        "decoupled holds the unfilled placeholder ${decoupled_mode}",
        "data_type holds the unfilled placeholder ${logits_datatype}",
        "count holds the unfilled placeholder ${preprocessing_instance_count}",
    ):
        assert expected in errors
    assert "tokenizer_dir" not in errors, "placeholders in parameter values are harmless (unset)"


def test_validate_repo_after_fill_template_is_clean(tmp_path, fake_model):
    repo = tmp_path / "repo"
    shutil.copytree(template_dir(), repo)
    fill_template(repo / "ensemble" / "config.pbtxt", "triton_max_batch_size:8,logits_datatype:TYPE_FP32")
    fill_template(
        repo / "preprocessing" / "config.pbtxt",
        f"triton_max_batch_size:8,tokenizer_dir:{fake_model},preprocessing_instance_count:1",
    )
    fill_template(repo / "postprocessing" / "config.pbtxt", "triton_max_batch_size:8,postprocessing_instance_count:1")
    fill_template(
        repo / "tensorrt_llm" / "config.pbtxt",
        f"triton_backend:python,triton_max_batch_size:8,decoupled_mode:true,engine_dir:{fake_model},"
        "encoder_input_features_data_type:TYPE_FP16,logits_datatype:TYPE_FP32",
    )
    # TensorRT-LLM's documented command line for its BLS template
    fill_template(
        repo / "tensorrt_llm_bls" / "config.pbtxt",
        "triton_max_batch_size:8,decoupled_mode:False,bls_instance_count:1,accumulate_tokens:False,"
        "tensorrt_llm_model_name:tensorrt_llm,tensorrt_llm_draft_model_name:,multimodal_encoders_name:,"
        "prompt_embedding_table_data_type:TYPE_FP16,logits_datatype:TYPE_FP32",
    )
    assert validate_repo(repo) == []
    parse(repo / "tensorrt_llm" / "config.pbtxt")  # parses although parameters still hold placeholders


def test_validate_repo_finds_missing_step_models_and_version_folders(built):
    shutil.rmtree(built / "postprocessing")
    shutil.rmtree(built / "ensemble" / "1")
    errors = "\n".join(validate_repo(built))
    assert "ensemble step model 'postprocessing'" in errors
    assert "ensemble: no version folder" in errors


@pytest.mark.parametrize("template", ["tensorrt_llm/1/model.yaml", "llmapi/tensorrt_llm/1/model.yaml"])
def test_every_commented_engine_argument_of_a_template_is_one_the_engine_takes(template):
    """A user uncomments what model.yaml shows: every commented key (values as shown) must be an engine argument
    the embedded engine knows and accepts, none left over in `extra`."""
    import re

    from tritonllm.engine.config import EngineConfig

    text = (template_dir() / template).read_text().split("triton_config:")[0]
    shown = [re.match(r"^# ( *)([a-z_]+):(.*)$", line) for line in text.splitlines()]
    lines = [f"{m.group(1)}{m.group(2)}:{m.group(3).split('#')[0].rstrip()}" for m in shown if m]
    arguments = yaml.safe_load("\n".join(lines))
    assert {"kv_cache_config", "quant_config", "dtype"} <= set(arguments)
    config = EngineConfig.from_dict({**arguments, "model": "m"})
    assert config.extra == {}
    assert config.quant_config is not None and config.kv_cache_config.dtype == "auto"
