"""Weightless model folders (`tritonllm model shape`) and the loader's `load_format="dummy"`: the published shapes
are read alike by the engine and transformers, and dummy weights are complete, tame and the same on every load."""

import json
import math

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tritonllm.checkpoints.shapes import SHAPE_NAMES, SHAPES, write_model_shape, write_shape_folder
from tritonllm.checkpoints.tiny import ARCHITECTURES, build_tiny_model, tiny_config, trained_tokenizer_json
from tritonllm.commands.main import main
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.loader import DUMMY_STD, ModelLoadError, load_model, read_model_config
from tritonllm.engine.embedded.network.layers import RMSNorm
from tritonllm.engine.types import SamplingParams

SHAPE_FILES = {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
# Parameter counts of the released models, in millions (embeddings included, a tied head counted once).
RELEASED_MILLIONS = {
    "smollm2-135m": 134.5,
    "qwen2.5-0.5b": 494.0,
    "qwen3-0.6b": 596.0,
    "llama-3.2-1b": 1235.8,
    "llama-3.1-8b": 8030.3,
    "phi-3-mini-4k-instruct": 3821.1,
    "phi-3.5-mini-instruct": 3821.1,
    "mixtral-8x7b": 46702.8,  # its card's 46.7B
    "qwen3-30b-a3b": 30532.1,  # its card's 30.5B
    "gemma-2-2b": 2614.3,
    "gemma-3-1b": 999.9,
}
# The published sliding windows (the engine resolves one past max_seq_len to full attention).
PUBLISHED_WINDOWS = {
    "phi-3-mini-4k-instruct": 2047,
    "phi-3.5-mini-instruct": 262144,
    "gemma-2-2b": 4096,
    "gemma-3-1b": 512,
}
PUBLISHED_ROPE = {"phi-3.5-mini-instruct": "longrope"}


def tiny_vocab() -> int:
    return Tokenizer.from_str(trained_tokenizer_json()).get_vocab_size()


def weightless_tiny(tmp_path, arch="llama", **changes):
    return write_shape_folder({**tiny_config(arch, tiny_vocab()), **changes}, tmp_path / f"{arch}-shape")


# ---- shapes ----


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_each_shape_is_a_weightless_folder_the_engine_reads(name, tmp_path):
    folder = write_model_shape(name, tmp_path / name)
    assert {p.name for p in folder.iterdir()} == SHAPE_FILES
    config = read_model_config(folder)
    published = SHAPES[name]
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (
        published["num_hidden_layers"],
        published["hidden_size"],
        published["vocab_size"],
    )
    assert config.head_dim == published.get("head_dim", published["hidden_size"] // published["num_attention_heads"])
    assert config.qkv_bias == (published["model_type"] == "qwen2")
    assert config.qk_norm == (published["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"))
    assert config.sliding_window == PUBLISHED_WINDOWS.get(name)
    assert config.rope.rope_type == ("llama3" if name.startswith("llama-3") else PUBLISHED_ROPE.get(name, "default"))
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == published["torch_dtype"]


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_transformers_builds_each_shape_with_the_released_size(name, tmp_path):
    config = AutoConfig.from_pretrained(write_model_shape(name, tmp_path / name))
    assert config.architectures == SHAPES[name]["architectures"]
    with torch.device("meta"):  # shapes only: nothing is allocated, not even for 8B
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    assert millions == pytest.approx(RELEASED_MILLIONS[name], abs=0.5)


def test_shape_command_writes_a_folder_whose_tokenizer_gives_valid_ids(tmp_path, capsys):
    assert main(["model", "shape", "qwen3-0.6b", "--out", str(tmp_path / "q")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "q")
    ids = AutoTokenizer.from_pretrained(tmp_path / "q").encode("The capital of France is")
    assert ids and max(ids) < SHAPES["qwen3-0.6b"]["vocab_size"]


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_each_shape_loads_with_dummy_weights(name, tmp_path):
    # One layer, a small vocabulary and MLP keep the attention widths and every kind of parameter at a test's cost.
    small = {"num_hidden_layers": 1, "vocab_size": 1024, "intermediate_size": 512, "moe_intermediate_size": 64}
    folder = write_shape_folder({**SHAPES[name], **small}, tmp_path / name)
    model, config = load_model(folder, torch.bfloat16, "cpu", load_format="dummy")
    assert config.hidden_size == SHAPES[name]["hidden_size"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- dummy weights ----


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_dummy_load_is_complete_tame_and_the_same_every_time(arch, tmp_path):
    folder = weightless_tiny(tmp_path, arch)
    first, _ = load_model(folder, torch.float32, "cpu", load_format="dummy")
    second, _ = load_model(folder, torch.float32, "cpu", load_format="dummy")
    # each norm's scale-by-one weight: 1, or 0 for Gemma's 1 + weight
    norms = {f"{name}.weight": m.identity_weight for name, m in first.named_modules() if isinstance(m, RMSNorm)}
    assert any("q_norm" in name for name in norms) == (arch in ("qwen3", "qwen3_moe", "gemma3"))
    for (name, param), (_, again) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(param, again), name  # uninitialised storage would differ between loads
        if name in norms:
            assert torch.all(param == norms[name]), name
        elif name.endswith(".bias"):
            assert torch.all(param == 0), name
        else:
            assert param.mean().abs() < 0.005 and param.std() == pytest.approx(DUMMY_STD, rel=0.1), name
    assert any(name.endswith(".bias") for name, _ in first.named_parameters()) == (arch in ("qwen2", "qwen2_moe"))


def test_dummy_load_ignores_weight_files_and_auto_still_needs_them(tmp_path):
    with_weights = build_tiny_model(tmp_path / "tiny", seed=1)  # its norm scales are random
    model, _ = load_model(with_weights, torch.float32, "cpu", load_format="dummy")
    assert torch.all(model.norm.weight == 1)
    with pytest.raises(ModelLoadError, match="no weight file"):
        load_model(weightless_tiny(tmp_path), torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match="load_format"):
        load_model(with_weights, torch.float32, "cpu", load_format="pt")


def test_engine_generates_from_a_deep_dummy_model_in_bfloat16(tmp_path):
    # 32 layers in bf16: dummy weights must keep activations finite (a NaN or inf shows in the log-probabilities).
    folder = weightless_tiny(tmp_path, "qwen3", num_hidden_layers=32, hidden_size=256, intermediate_size=768)
    engine = EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(folder),
                "dtype": "bfloat16",
                "device": "cpu",
                "load_format": "dummy",
                "max_seq_len": 128,
                "kv_cache_config": {"max_tokens": 512},
            }
        )
    )
    try:
        outputs = [
            engine.generate_async(list(range(3, 3 + n)), SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True))
            for n in (4, 20)
        ]
        for output in (handle.result().outputs[0] for handle in outputs):
            assert len(output.token_ids) == 5
            assert all(math.isfinite(value) for value in output.logprobs)
    finally:
        engine.shutdown()
