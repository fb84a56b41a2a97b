"""Model folders: the tiny random models, the SmolLM2 conversion, and the loader's errors on broken folders."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritonllm.checkpoints.tiny import ARCHITECTURES, EOS_TOKEN_ID, PAD_TOKEN_ID, build_tiny_model, corpus_text
from tritonllm.engine.embedded.loader import ModelLoadError, load_model, read_model_config

MULTI_BYTE_TEXT = "Renée's crème brûlée, Ångström, 北京, 你好 🌊😊 — <|im_end|> 48,213"
TINY_FILES = {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=0, arch="llama")


def broken_copy(source, tmp_path, name="broken"):
    return shutil.copytree(source, tmp_path / name)


# ---- tiny models ----


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_is_byte_identical_for_a_seed(arch, tmp_path):
    first = build_tiny_model(tmp_path / "a", seed=7, arch=arch)
    second = build_tiny_model(tmp_path / "b", seed=7, arch=arch)
    other_seed = build_tiny_model(tmp_path / "c", seed=8, arch=arch)
    assert {p.name for p in first.iterdir()} == TINY_FILES
    for name in TINY_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other_seed / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_loads_in_transformers_with_random_norms_and_biases(arch, tmp_path):
    model_dir = build_tiny_model(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    for name, param in model.named_parameters():
        assert param.std() > 0.05, name  # norm scales and biases too: nothing left at ones or zeros
    tensors = load_file(model_dir / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert any(name.endswith("q_proj.bias") for name in tensors) == (arch in ("qwen2", "qwen2_moe"))
    assert any(name.endswith("q_norm.weight") for name in tensors) == (arch in ("qwen3", "qwen3_moe", "gemma3"))
    untied = ("llama", "mistral", "phi3", "phi3-longrope", "mixtral", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3")
    assert ("lm_head.weight" in tensors) == (arch in untied)


def test_tiny_config_is_readable_by_transformers_4_and_5(tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["eos_token_id"] == EOS_TOKEN_ID
    tokenizer_config = json.loads((tiny_llama / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["model_input_names"] == ["input_ids", "attention_mask"]
    assert "extra_special_tokens" not in tokenizer_config
    generation = json.loads((tiny_llama / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (EOS_TOKEN_ID, PAD_TOKEN_ID)


def test_corpus_has_multi_byte_characters():
    text = corpus_text()
    assert 3000 <= len(text.encode("utf-8")) <= 6500
    assert any(0x80 <= ord(c) < 0x800 for c in text)  # accented Latin (2 bytes)
    assert any(0x4E00 <= ord(c) <= 0x9FFF for c in text)  # CJK (3 bytes)
    assert any(ord(c) >= 0x1F300 for c in text)  # emoji (4 bytes)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_round_trips_multi_byte_text(arch, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path, arch=arch))
    encoded = tokenizer(MULTI_BYTE_TEXT)
    assert set(encoded) == {"input_ids", "attention_mask"}  # no token_type_ids, no BOS
    ids = encoded["input_ids"]
    assert tokenizer.decode(ids) == MULTI_BYTE_TEXT
    assert EOS_TOKEN_ID in ids and ids[0] != EOS_TOKEN_ID
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", EOS_TOKEN_ID)
    assert tokenizer.pad_token_id == PAD_TOKEN_ID
    assert len(tokenizer) == 1000


def test_chat_template_renders_chatml(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare ?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nOù est la gare ?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert ids.count(1) == 3 and ids.count(EOS_TOKEN_ID) == 2  # special tokens are single ids


def test_unknown_tiny_architecture_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="gpt2"):
        build_tiny_model(tmp_path, arch="gpt2")


# ---- loader ----


def test_loader_reads_sharded_checkpoints(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path, "sharded")
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, model_dir / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = load_model(model_dir, torch.float32, "cpu")
    reference, _ = load_model(tiny_llama, torch.float32, "cpu")
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(param, expected), name


def test_loader_ignores_saved_rotary_frequencies(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, model_dir / "model.safetensors")
    load_model(model_dir, torch.float32, "cpu")


def test_missing_config_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(model_dir, torch.float32, "cpu")


def test_config_that_is_not_json_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json.*not valid JSON"):
        read_model_config(model_dir)


def test_unsupported_architecture_is_named_with_the_supported_ones(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(model_dir, torch.float32, "cpu")


def test_missing_weight_file_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weight file.*model.safetensors"):
        load_model(model_dir, torch.float32, "cpu")


def test_missing_shard_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    (model_dir / "model.safetensors").unlink()
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00001-of-00001.safetensors"):
        load_model(model_dir, torch.float32, "cpu")


def test_truncated_safetensors_file_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(model_dir, torch.float32, "cpu")


def test_garbage_weight_file_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(model_dir, torch.float32, "cpu")


def rewrite_tensors(model_dir, change):
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    rewrite_tensors(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir, torch.float32, "cpu")


def test_wrong_shaped_tensor_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    rewrite_tensors(model_dir, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(5, 64)}))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \[5, 64\], expected \[32, 64\]"):
        load_model(model_dir, torch.float32, "cpu")


def test_unexpected_tensor_is_named(tiny_llama, tmp_path):
    model_dir = broken_copy(tiny_llama, tmp_path)
    rewrite_tensors(model_dir, lambda t: t.update({"model.layers.0.self_attn.mystery.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match="unexpected tensor model.layers.0.self_attn.mystery.weight"):
        load_model(model_dir, torch.float32, "cpu")


# ---- SmolLM2 ----


@pytest.mark.slow
def test_smollm2_folder_is_complete_and_portable(smollm2_dir):
    from tritonllm.checkpoints.smollm2 import COMPLETE_MARKER, fetch_smollm2

    assert (smollm2_dir / COMPLETE_MARKER).is_file()
    assert fetch_smollm2(smollm2_dir, progress=False) == smollm2_dir  # complete: returns at once
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["rope_parameters"]["rope_theta"] == 100000.0
    assert read_model_config(smollm2_dir).rope.theta == 100000.0
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "extra_special_tokens" not in tokenizer_config and "chat_template" in tokenizer_config
    assert {t.dtype for t in load_file(smollm2_dir / "model.safetensors").values()} == {torch.bfloat16}
