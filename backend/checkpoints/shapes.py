"""Real models' shapes without their weights: `tritonllm model shape NAME --out DIR` writes a folder holding the
published Hugging Face `config.json` of a model and the project's tiny BPE tokenizer, for benchmarks that load
random weights (`load_format: dummy` in the engine, `from_config` on the Hugging Face side).

The tokenizer is not the model's own (its ids are all below 1,000, far under every vocabulary here): benchmark
prompts only need valid token ids, and it keeps the folder small and offline. Each config below is the model's
published config.json (its `transformers_version` left out), so the layer count, widths, heads, vocabulary and
RoPE settings are the real ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from .hf_files import write_json
from .tiny import write_tokenizer_files

_LLAMA_COMMON = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    mlp_bias=False,
    pretraining_tp=1,
    initializer_range=0.02,
    use_cache=True,
    torch_dtype="bfloat16",
)
# Llama 3.1 and 3.2 stretch RoPE from the 8k pre-training context with the `llama3` rule.
_LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": dict(
        _LLAMA_COMMON,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000,
        rope_scaling=None,
        rope_interleaved=False,
        rms_norm_eps=1e-05,
        tie_word_embeddings=True,
        initializer_range=0.041666666666666664,
        is_llama_config=True,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # Qwen/Qwen2.5-0.5B (Qwen2 has q/k/v biases by architecture: its config carries no attention_bias key)
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=24,
        use_mrope=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151643,
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_act="silu",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000,
        rope_scaling=None,
        rms_norm_eps=1e-06,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(
        _LLAMA_COMMON,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        rms_norm_eps=1e-05,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(
        _LLAMA_COMMON,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE),
        rms_norm_eps=1e-05,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336, top 2, on all 32 layers
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_act="silu",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-05,
        sliding_window=None,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        output_router_logits=False,
        router_aux_loss_coef=0.02,
        use_cache=True,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, top 8 renormalised, on all 48 layers
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        head_dim=128,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        max_position_embeddings=40960,
        max_window_layers=48,
        rope_scaling=None,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=False,
        initializer_range=0.02,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        use_cache=True,
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}
SHAPE_NAMES = tuple(SHAPES)


def write_model_shape(name: str, out_dir: Union[str, Path]) -> Path:
    """The folder for shape `name` (one of SHAPE_NAMES): config.json and tokenizer files, no weights."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPE_NAMES)}")
    return write_shape_folder(SHAPES[name], out_dir)


def write_shape_folder(config: dict[str, Any], out_dir: Union[str, Path]) -> Path:
    """A weightless model folder for any config.json contents (tests use a tiny one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    write_tokenizer_files(out)
    return out
