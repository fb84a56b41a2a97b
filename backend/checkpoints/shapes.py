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
# Phi-3.5-mini's LongRoPE: one factor per rotated pair of its 96-wide heads (short up to 4k tokens, long past it).
_PHI35_LONG_FACTOR = [
    1.0800000429153442,
    1.1100000143051147,
    1.1399999856948853,
    1.340000033378601,
    1.5899999141693115,
    1.600000023841858,
    1.6200000047683716,
    2.620000123977661,
    3.2300000190734863,
    3.2300000190734863,
    4.789999961853027,
    7.400000095367432,
    7.700000286102295,
    9.09000015258789,
    12.199999809265137,
    17.670000076293945,
    24.46000099182129,
    28.57000160217285,
    30.420001983642578,
    30.840002059936523,
    32.590003967285156,
    32.93000411987305,
    42.320003509521484,
    44.96000289916992,
    50.340003967285156,
    50.45000457763672,
    57.55000305175781,
    57.93000411987305,
    58.21000289916992,
    60.1400032043457,
    62.61000442504883,
    62.62000274658203,
    62.71000289916992,
    63.1400032043457,
    63.1400032043457,
    63.77000427246094,
    63.93000411987305,
    63.96000289916992,
    63.970001220703125,
    64.02999877929688,
    64.06999969482422,
    64.08000183105469,
    64.12000274658203,
    64.41000366210938,
    64.4800033569336,
    64.51000213623047,
    64.52999877929688,
    64.83999633789062,
]
_PHI35_SHORT_FACTOR = [
    1.0,
    1.0199999809265137,
    1.0299999713897705,
    1.0299999713897705,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0499999523162842,
    1.0699999332427979,
    1.0999999046325684,
    1.1099998950958252,
    1.1599998474121094,
    1.1599998474121094,
    1.1699998378753662,
    1.2899998426437378,
    1.339999794960022,
    1.679999828338623,
    1.7899998426437378,
    1.8199998140335083,
    1.8499997854232788,
    1.8799997568130493,
    1.9099997282028198,
    1.9399996995925903,
    1.9899996519088745,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0199997425079346,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0299997329711914,
    2.0799996852874756,
    2.0899996757507324,
    2.189999580383301,
    2.2199995517730713,
    2.5899994373321533,
    2.729999542236328,
    2.749999523162842,
    2.8399994373321533,
]
# The Phi-3 configs leave out `auto_map` and `_name_or_path` too: transformers ships the Phi3ForCausalLM class.
_PHI3_COMMON = dict(
    architectures=["Phi3ForCausalLM"],
    model_type="phi3",
    hidden_act="silu",
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32064,
    original_max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-05,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_dropout=0.0,
    embd_pdrop=0.0,
    resid_pdrop=0.0,
    initializer_range=0.02,
    use_cache=True,
    torch_dtype="bfloat16",
    bos_token_id=1,
    eos_token_id=32000,
    pad_token_id=32000,
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
    # microsoft/Phi-3-mini-4k-instruct (a 2047-token sliding window on every layer, no RoPE scaling)
    "phi-3-mini-4k-instruct": dict(
        _PHI3_COMMON,
        max_position_embeddings=4096,
        rope_scaling=None,
        sliding_window=2047,
    ),
    # microsoft/Phi-3.5-mini-instruct (128k positions by LongRoPE; its 262144-token window covers every position)
    "phi-3.5-mini-instruct": dict(
        _PHI3_COMMON,
        max_position_embeddings=131072,
        rope_scaling=dict(type="longrope", long_factor=_PHI35_LONG_FACTOR, short_factor=_PHI35_SHORT_FACTOR),
        sliding_window=262144,
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
