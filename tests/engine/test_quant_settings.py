"""quant_config in model.yaml (EngineConfig) and the checkpoint's quantization_config, resolved into
QuantSettings; every refusal names its key."""

import pytest

from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded.network.model_config import ModelLoadError
from tritonllm.engine.embedded.quant.settings import from_checkpoint, resolve

CT_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
            "input_activations": None,
        }
    },
    "ignore": ["lm_head"],
}


def test_quant_config_is_validated_with_the_key_named():
    config = EngineConfig.from_dict({"model": "m", "quant_config": {"quant_algo": "W4A16", "group_size": 64}})
    assert config.quant_config == {"quant_algo": "W4A16", "group_size": 64}
    with pytest.raises(ConfigError, match=r"quant_config.quant_algo must be one of \['FP8'.*got 'NVFP4'"):
        EngineConfig.from_dict({"model": "m", "quant_config": {"quant_algo": "NVFP4"}})
    with pytest.raises(ConfigError, match="quant_config: unknown key.*smoothquant_val"):
        EngineConfig.from_dict({"model": "m", "quant_config": {"smoothquant_val": 0.5}})
    with pytest.raises(ConfigError, match="quant_config.group_size must be an integer >= 1"):
        EngineConfig.from_dict({"model": "m", "quant_config": {"quant_algo": "W4A16", "group_size": 0}})
    with pytest.raises(ConfigError, match="quant_config.kv_cache_quant_algo must be one of"):
        EngineConfig.from_dict({"model": "m", "quant_config": {"kv_cache_quant_algo": "INT8"}})


def test_on_load_settings_from_quant_config():
    assert resolve(None, None) is None
    assert resolve({"quant_algo": None}, None) is None
    fp8 = resolve({"quant_algo": "FP8"}, None)
    assert (fp8.kind, fp8.source, fp8.static_input) == ("fp8", "on_load", False)
    assert resolve({"quant_algo": "W8A16"}, None).group_size is None  # per channel
    int4 = resolve({"quant_algo": "W4A16"}, None)
    assert (int4.kind, int4.group_size) == ("int4", 128)
    excluded = resolve({"quant_algo": "W4A16", "exclude_modules": ["*down_proj"]}, None)
    assert not excluded.quantizes("model.layers.0.mlp.down_proj")
    assert excluded.quantizes("model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("algo", ["W4A16_AWQ", "W4A16_GPTQ"])
def test_awq_or_gptq_asked_of_an_unquantized_checkpoint_is_an_error(algo):
    with pytest.raises(ModelLoadError, match=f"quant_config.quant_algo='{algo}' needs a checkpoint already quantized"):
        resolve({"quant_algo": algo}, None)


def test_compressed_tensors_settings():
    settings = from_checkpoint(CT_W4A16)
    assert (settings.kind, settings.group_size, settings.ct_format, settings.symmetric) == (
        "int4",
        32,
        "pack-quantized",
        True,
    )
    assert settings.quantizes("model.layers.0.self_attn.q_proj") and not settings.quantizes("lm_head")
    assert resolve({"quant_algo": "W4A16"}, CT_W4A16) == settings


def test_a_quant_config_contradicting_the_checkpoint_names_both():
    with pytest.raises(ModelLoadError, match=r"quant_config.quant_algo='FP8' contradicts the checkpoint's quantiz"):
        resolve({"quant_algo": "FP8"}, CT_W4A16)
    with pytest.raises(ModelLoadError, match="quant_config.group_size=128 contradicts.*group_size 32"):
        resolve({"quant_algo": "W4A16", "group_size": 128}, CT_W4A16)
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    with pytest.raises(ModelLoadError, match="'W4A16_GPTQ' contradicts.*awq"):
        resolve({"quant_algo": "W4A16_GPTQ"}, awq)


@pytest.mark.parametrize(
    "config, named",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, r"quantization_config.desc_act=true"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, r"quantization_config.bits=3"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"quantization_config.version='gemv'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"quantization_config.weight_block_size"),
        ({"quant_method": "bitsandbytes"}, r"quantization_config.quant_method='bitsandbytes' is not supported"),
        (
            {**CT_W4A16, "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "block"}}}},
            r"config_groups.g.weights.strategy='block'",
        ),
        (
            {
                **CT_W4A16,
                "config_groups": {
                    "g": {
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            },
            r"config_groups.g.input_activations: quantized activations with int weights",
        ),
    ],
)
def test_unsupported_checkpoint_quantization_is_refused_by_name(config, named):
    with pytest.raises(ModelLoadError, match=named):
        from_checkpoint(config)


def test_gptq_zero_point_offset_follows_the_checkpoint_format():
    v1 = from_checkpoint({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False})
    v2 = from_checkpoint({"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"})
    assert (v1.gptq_zero_offset, v1.group_size) == (1, 32)
    assert (v2.gptq_zero_offset, v2.group_size) == (0, None)


def test_the_embedded_engine_takes_an_fp8_kv_cache_and_the_adapter_passes_quant_config():
    from tritonllm.engine import trtllm_args
    from tritonllm.engine.config import kv_cache_fp8

    config = EngineConfig.from_dict({"model": "m", "quant_config": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}})
    assert config.embedded_unsupported() == [] and kv_cache_fp8(config)
    plain = EngineConfig.from_dict({"model": "m", "quant_config": {"quant_algo": "W4A16"}})
    assert plain.embedded_unsupported() == []
    kwargs = trtllm_args._optional_llm_kwargs(plain)
    assert kwargs["quant_config"] == {"quant_algo": "W4A16"}
    assert "quant_config" not in trtllm_args._optional_llm_kwargs(EngineConfig.from_dict({"model": "m"}))
