"""The embedded engine's Llama-family model code against Hugging Face transformers, on tiny random models."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritonllm.checkpoints.tiny import ARCHITECTURES, TINY_SLIDING_WINDOW, build_tiny_model
from tritonllm.engine.embedded.attention import AttentionMetadata, build_decode_mask
from tritonllm.engine.embedded.loader import ModelLoadError, load_model, read_model_config
from tritonllm.engine.embedded.network.model_config import ModelConfig

BLOCK_SIZE = 4
PROMPT = [301, 279, 349, 223, 22, 26, 14, 20, 547, 887, 837, 397, 237, 235, 223, 2, 1, 55]


def empty_caches(config: ModelConfig, num_blocks: int):
    shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]


def prefill(model, config, ids: list[int], caches=None):
    """One sequence, all of `ids` in one step; returns logits [T, vocab] and the caches."""
    num_blocks = -(-len(ids) // BLOCK_SIZE) + 1
    caches = caches or empty_caches(config, num_blocks)
    length = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(length),
        block_tables=torch.arange(num_blocks)[None],
        query_starts=[0],
        query_lens=[length],
        context_lens=[length],
        block_size=BLOCK_SIZE,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(length), meta, caches)
        return model.compute_logits(hidden), caches


def decode_step(model, token: int, position: int, caches):
    """One more token of the same sequence, through the batched decode path."""
    num_blocks = caches[0][0].shape[0]
    context = position + 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([position]),
        block_tables=torch.arange(num_blocks)[None],
        query_starts=[0],
        query_lens=[1],
        context_lens=[context],
        block_size=BLOCK_SIZE,
        decode_mask=build_decode_mask([context], BLOCK_SIZE, num_blocks, "cpu"),
    )
    with torch.no_grad():
        hidden = model(torch.tensor([token]), torch.tensor([position]), meta, caches)
        return model.compute_logits(hidden)[0]


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), seed=3, arch=request.param)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=5, arch="llama")


def test_prefill_logits_match_hf(tiny_dir):
    model, config = load_model(tiny_dir, torch.float32, "cpu")
    logits, _ = prefill(model, config, PROMPT)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(tiny_dir, PROMPT), atol=1e-4, rtol=1e-4)


def test_decode_step_after_prefill_matches_full_prefill(tiny_dir):
    model, config = load_model(tiny_dir, torch.float32, "cpu")
    _, caches = prefill(model, config, PROMPT[:-1])
    last = decode_step(model, PROMPT[-1], len(PROMPT) - 1, caches)
    torch.testing.assert_close(last, hf_logits(tiny_dir, PROMPT)[-1], atol=1e-4, rtol=1e-4)


def test_greedy_decoding_matches_hf_generate(tiny_dir):
    model, config = load_model(tiny_dir, torch.float32, "cpu")
    prompt, new_tokens = PROMPT[:6], 12
    caches = empty_caches(config, -(-(len(prompt) + new_tokens) // BLOCK_SIZE))
    logits, caches = prefill(model, config, prompt, caches)
    generated = [int(logits[-1].argmax())]
    while len(generated) < new_tokens:
        step_logits = decode_step(model, generated[-1], len(prompt) + len(generated) - 1, caches)
        generated.append(int(step_logits.argmax()))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )[0, len(prompt) :].tolist()
    assert generated == expected
    assert len(set(generated)) > 3  # the tiny models must not collapse into repeating one token


def test_bfloat16_load_keeps_logits_in_float32(tiny_dir):
    model, config = load_model(tiny_dir, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in empty_caches(config, 6)]
    logits, _ = prefill(model, config, PROMPT, caches)
    assert logits.dtype == torch.float32
    reference = hf_logits(tiny_dir, PROMPT)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.8,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
    },
}


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_rope_scaling_matches_hf(variant, llama_dir, tmp_path):
    model_dir = shutil.copytree(llama_dir, tmp_path / variant)
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["rope_parameters"] = {**ROPE_VARIANTS[variant], "rope_theta": config["rope_theta"]}
    config_file.write_text(json.dumps(config))
    model, parsed = load_model(model_dir, torch.float32, "cpu")
    assert parsed.rope.rope_type == ROPE_VARIANTS[variant]["rope_type"]
    logits, _ = prefill(model, parsed, PROMPT)
    torch.testing.assert_close(logits, hf_logits(model_dir, PROMPT), atol=1e-4, rtol=1e-4)


def test_transformers4_rope_scaling_is_read(llama_dir, tmp_path):
    model_dir = shutil.copytree(llama_dir, tmp_path / "v4")
    config = json.loads((model_dir / "config.json").read_text())
    del config["rope_parameters"]
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    config["rope_theta"] = 5000.0
    (model_dir / "config.json").write_text(json.dumps(config))
    parsed = read_model_config(model_dir)
    assert (parsed.rope.rope_type, parsed.rope.theta, parsed.rope.params) == ("linear", 5000.0, {"factor": 2.0})
    model, _ = load_model(model_dir, torch.float32, "cpu")
    logits, _ = prefill(model, parsed, PROMPT)
    torch.testing.assert_close(logits, hf_logits(model_dir, PROMPT), atol=1e-4, rtol=1e-4)


def raw_config(**overrides):
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return {**base, **overrides}


def test_unknown_rope_type_is_an_error_naming_it():
    with pytest.raises(ModelLoadError, match="longrope"):
        ModelConfig.from_dict(raw_config(rope_scaling={"rope_type": "longrope", "factor": 2.0}))


def test_model_config_fields(tiny_dir):
    config = read_model_config(tiny_dir)
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert config.num_layers == raw["num_hidden_layers"]
    assert config.head_dim == raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    assert config.kv_bytes_per_token(torch.float32) == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert config.kv_bytes_per_token(torch.bfloat16) * 2 == config.kv_bytes_per_token(torch.float32)
    assert (config.vocab_size, config.max_position_embeddings, config.torch_dtype) == (
        raw["vocab_size"],
        4096,
        "float32",
    )
    window = TINY_SLIDING_WINDOW if raw["model_type"] in ("mistral", "gemma2", "gemma3_text") else None
    assert config.eos_token_id == 2 and config.sliding_window == window
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]


@pytest.mark.parametrize(
    "overrides, window",
    [
        (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096), 4096),
        (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None), None),
        (
            dict(
                architectures=["Qwen2ForCausalLM"],
                model_type="qwen2",
                use_sliding_window=True,
                sliding_window=2048,
                max_window_layers=0,
            ),
            2048,
        ),
        (
            dict(
                architectures=["Qwen2ForCausalLM"],
                model_type="qwen2",
                use_sliding_window=True,
                sliding_window=2048,
                max_window_layers=2,
            ),
            None,
        ),  # every layer is below max_window_layers: no layer slides
        (
            dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False, sliding_window=2048),
            None,
        ),
        (
            dict(
                architectures=["Qwen3ForCausalLM"],
                model_type="qwen3",
                use_sliding_window=True,
                sliding_window=1024,
                layer_types=["full_attention", "sliding_attention"],
            ),
            1024,
        ),
    ],
)
def test_sliding_window_recorded_only_when_in_use(overrides, window):
    assert ModelConfig.from_dict(raw_config(**overrides)).sliding_window == window


@pytest.mark.parametrize(
    "overrides, windows",
    [
        (dict(architectures=["MistralForCausalLM"], model_type="mistral", num_hidden_layers=3), (4096,) * 3),
        (
            dict(
                architectures=["Qwen2ForCausalLM"],
                model_type="qwen2",
                num_hidden_layers=3,
                use_sliding_window=True,
                sliding_window=64,
                max_window_layers=1,
            ),
            (None, 64, 64),  # transformers: layers at index >= max_window_layers slide
        ),
        (
            dict(
                architectures=["Qwen3ForCausalLM"],
                model_type="qwen3",
                num_hidden_layers=2,
                use_sliding_window=True,
                sliding_window=32,
                layer_types=["sliding_attention", "full_attention"],
            ),
            (32, None),
        ),
        (dict(num_hidden_layers=2), ()),
    ],
)
def test_each_layer_gets_the_window_transformers_gives_it(overrides, windows):
    assert ModelConfig.from_dict(raw_config(**overrides)).layer_windows == windows


@pytest.mark.parametrize("bad", [-1, 2.5, "16"])
def test_a_bad_sliding_window_is_a_load_error_naming_it(bad):
    raw = raw_config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=bad)
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelConfig.from_dict(raw)


def test_architecture_flags():
    qwen2 = ModelConfig.from_dict(raw_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelConfig.from_dict(raw_config(architectures=["Qwen3ForCausalLM"], model_type="qwen3"))
    assert (qwen3.qk_norm, qwen3.head_dim) == (True, 128)  # Qwen3's default head_dim is 128, not hidden / heads
    llama = ModelConfig.from_dict(raw_config(attention_bias=True, mlp_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    no_list = ModelConfig.from_dict({**raw_config(model_type="mistral"), "architectures": None})
    assert no_list.architecture == "MistralForCausalLM"


def test_llama_biases_match_hf(llama_dir, tmp_path):
    """attention_bias / mlp_bias: add random biases to the tiny Llama and compare with HF."""
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(llama_dir, tmp_path / "biased")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(attention_bias=True, mlp_bias=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if any(part in name for part in ("_proj.weight",)):
            rows = tensors[name].shape[0]
            tensors[name.replace(".weight", ".bias")] = torch.randn(rows, generator=generator) * 0.3
    save_file(tensors, model_dir / "model.safetensors")
    model, parsed = load_model(model_dir, torch.float32, "cpu")
    logits, _ = prefill(model, parsed, PROMPT)
    torch.testing.assert_close(logits, hf_logits(model_dir, PROMPT), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_logits_match_hf_and_it_knows_paris(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
        answer = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)

    model, config = load_model(smollm2_dir, torch.float32, "cpu")
    caches = empty_caches(config, -(-(len(prompt) + len(answer)) // BLOCK_SIZE))
    logits, caches = prefill(model, config, prompt, caches)
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)
    generated = [int(logits[-1].argmax())]
    while len(generated) < len(answer):
        generated.append(int(decode_step(model, generated[-1], len(prompt) + len(generated) - 1, caches).argmax()))
    assert generated == answer


def test_cpu_fp32_models_use_prepacked_matmuls_with_the_same_logits(llama_dir):
    """fp32 on CPU packs every projection and the output head for oneDNN; other dtypes keep the plain matmul."""
    from tritonllm.engine.embedded.network.cpu_gemm import packing_available
    from tritonllm.engine.embedded.network.layers import Linear

    model, config = load_model(llama_dir, torch.float32, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not packing_available():
        pytest.skip("this PyTorch build has no oneDNN weight packing")
    assert linears and all(m.packed is not None for m in linears) and model.packed_head is not None
    packed_logits, _ = prefill(model, config, PROMPT)
    for module in linears:
        module.packed = None
    model.packed_head = None
    plain_logits, _ = prefill(model, config, PROMPT)
    torch.testing.assert_close(packed_logits, plain_logits, atol=1e-5, rtol=1e-5)

    half, _ = load_model(llama_dir, torch.bfloat16, "cpu")
    assert half.packed_head is None and all(m.packed is None for m in half.modules() if isinstance(m, Linear))
