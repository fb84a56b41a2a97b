"""Tiny random-weight models in Hugging Face format, for fast tests: Llama, Mistral (sliding-window attention over
TINY_SLIDING_WINDOW tokens, so short prompts already outgrow it), Qwen2 (q/k/v biases), Qwen3 (q/k norms,
head_dim != hidden / heads), Phi-3 (fused qkv and gate-up tensors; `phi3-longrope` with LongRoPE over a
pre-training context of TINY_ORIGINAL_CONTEXT tokens), the mixtures of experts Mixtral (4 experts, top 2),
Qwen3-MoE (8 experts, top 2, renormalised) and Qwen2-MoE (4 experts, a shared expert, one dense layer), Gemma 2
(sliding and global layers alternating over TINY_SLIDING_WINDOW, attention and final logit soft-capping) and
Gemma 3 (5 sliding layers to 1 global, their own RoPE base, linear RoPE scaling on the global one, q/k norms), each
with a real byte-level BPE tokenizer trained on text we ship. Expert weights are saved per expert, under the
names published checkpoints use.

The same seed and architecture always give byte-identical files."""

from __future__ import annotations

import functools
import math
from importlib import resources
from pathlib import Path
from typing import Any, Union

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .hf_files import CHATML_TEMPLATE, portable_model_config, portable_tokenizer_config, special_tokens_map, write_json

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)
TOKENIZER_VOCAB_TARGET = 1000
MAX_POSITION_EMBEDDINGS = 4096
TINY_SLIDING_WINDOW = 16
# The tiny longrope Phi-3's pre-training context: prompts of a few dozen tokens already outgrow it.
TINY_ORIGINAL_CONTEXT = 32
_TINY_SHORT_FACTOR = [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.8, 2.0]
_TINY_LONG_FACTOR = [1.0, 1.5, 2.5, 4.0, 8.0, 16.0, 32.0, 64.0]

_COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=MAX_POSITION_EMBEDDINGS,
    initializer_range=0.02,
    attention_dropout=0.0,
    use_cache=True,
    bos_token_id=None,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
    dtype="float32",
)
# Gemma's keys (transformers' Gemma 2 / 3 read `hidden_activation`, not `hidden_act`).
_GEMMA_COMMON: dict[str, Any] = dict(
    head_dim=16,
    hidden_act="gelu_pytorch_tanh",
    hidden_activation="gelu_pytorch_tanh",
    # Real Gemma ties its head to the embedding; tied, the tiny one repeats one token (measured), so it does not.
    tie_word_embeddings=False,
    attention_bias=False,
    sliding_window=TINY_SLIDING_WINDOW,
)
_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        head_dim=16,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        head_dim=16,
        tie_word_embeddings=False,
        sliding_window=TINY_SLIDING_WINDOW,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=24,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
    ),
    "phi3": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        tie_word_embeddings=False,
        sliding_window=None,
        original_max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    ),
    # Phi-3.5's RoPE: one factor per rotated pair (head_dim 16: 8), short and long sets far apart; in `rope_scaling`
    # too, where transformers 4.x reads it (5.x takes it over rope_parameters, and they agree).
    "phi3-longrope": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        tie_word_embeddings=False,
        sliding_window=None,
        original_max_position_embeddings=TINY_ORIGINAL_CONTEXT,
        rope_scaling=dict(type="longrope", short_factor=_TINY_SHORT_FACTOR, long_factor=_TINY_LONG_FACTOR),
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            original_max_position_embeddings=TINY_ORIGINAL_CONTEXT,
            short_factor=_TINY_SHORT_FACTOR,
            long_factor=_TINY_LONG_FACTOR,
        ),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        head_dim=16,
        intermediate_size=96,  # each expert's
        tie_word_embeddings=False,
        sliding_window=None,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        output_router_logits=False,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=24,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    ),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # layer 1 keeps a dense MLP of intermediate_size
        output_router_logits=False,
    ),
    "gemma2": dict(
        _GEMMA_COMMON,
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        query_pre_attn_scalar=24,
        # Small caps, so that tanh bends the tiny model's scores and logits (50 and 30 in gemma-2-2b).
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma3": dict(
        _GEMMA_COMMON,
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        num_hidden_layers=6,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sliding_window_pattern=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        # transformers 5.x reads rope_parameters by layer type; 4.x the flat keys beside them.
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling=dict(rope_type="linear", factor=2.0),
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1_000_000.0),
            sliding_attention=dict(rope_type="default", rope_theta=10_000.0),
        ),
    ),
}
ARCHITECTURES = tuple(_ARCH_CONFIGS)


def build_tiny_model(out_dir: Union[str, Path], seed: int = 0, arch: str = "llama") -> Path:
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown tiny model architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = trained_tokenizer_json()
    config = tiny_config(arch, Tokenizer.from_str(tokenizer_json).get_vocab_size())
    save_file(random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID})
    write_tokenizer_files(out)
    return out


def write_tokenizer_files(out: Path) -> None:
    """The tiny BPE tokenizer's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json) in `out`."""
    (out / "tokenizer.json").write_text(trained_tokenizer_json(), encoding="utf-8")
    tokenizer_config = _tokenizer_config()
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(out / "special_tokens_map.json", special_tokens_map(tokenizer_config))


def tiny_config(arch: str, vocab_size: int) -> dict[str, Any]:
    return portable_model_config({**_COMMON, **_ARCH_CONFIGS[arch], "vocab_size": vocab_size})


def _is_gemma(config: dict[str, Any]) -> bool:
    return config["model_type"] in ("gemma2", "gemma3_text")


# ---- weights ----


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor random, biases and norm scales included, scaled so logits spread widely (no near-ties)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape, kind in _weight_specs(config):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        tensors[name] = _INIT[kind](noise, shape)
    return _fused_as_phi3(tensors) if config["model_type"] == "phi3" else tensors


def _fused_as_phi3(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3 checkpoints store q, k, v as one `qkv_proj` and gate, up as one `gate_up_proj`, stacked in that order."""
    fused = {}
    for name, tensor in tensors.items():
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name[: -len("q_proj.weight")]
            parts = [tensors[f"{prefix}{p}_proj.weight"] for p in "qkv"]
            fused[prefix + "qkv_proj.weight"] = torch.cat(parts)
        elif name.endswith("mlp.gate_proj.weight"):
            prefix = name[: -len("gate_proj.weight")]
            fused[prefix + "gate_up_proj.weight"] = torch.cat([tensor, tensors[prefix + "up_proj.weight"]])
        elif not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            fused[name] = tensor
    return fused


# Scales chosen by measurement: greedy decoding stays varied (a tied model whose embeddings dominate the residual
# stream just repeats its input token) and the top two logits stay well apart.
_INIT = {
    "embedding": lambda noise, shape: noise * 0.3,
    "gemma_embedding": lambda noise, shape: noise / math.sqrt(shape[1]),
    "linear": lambda noise, shape: noise / math.sqrt(shape[1]),  # keeps activations near unit scale
    "mixing": lambda noise, shape: noise * 2 / math.sqrt(shape[1]),  # q, k, o, down: sharper attention, more mixing
    "head": lambda noise, shape: noise * 0.5,
    "router": lambda noise, shape: noise * 3 / math.sqrt(shape[1]),  # decided routing: few near-tied experts
    "bias": lambda noise, shape: noise * 0.3,
    "norm": lambda noise, shape: 1.0 + noise * 0.2,
    "final_norm": lambda noise, shape: 3.0 * (1.0 + noise * 0.2),  # spreads the logits
    # Gemma's norms scale by 1 + weight: the same scales, stored minus one.
    "offset_norm": lambda noise, shape: noise * 0.2,
    "offset_final_norm": lambda noise, shape: 3.0 * (1.0 + noise * 0.2) - 1.0,
}


def _weight_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    qkv_bias = config["model_type"] in ("qwen2", "qwen2_moe") or config.get("attention_bias", False)
    gemma = _is_gemma(config)
    norm = "offset_norm" if gemma else "norm"
    # Gemma scales its embeddings by sqrt(hidden): smaller ones keep the residual stream at the others' scale.
    embedding = "gemma_embedding" if gemma else "embedding"
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], hidden), embedding)
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer_norms = ["input_layernorm", "post_attention_layernorm"]
        if gemma:
            layer_norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        specs += [(p + f"{name}.weight", (hidden,), norm) for name in layer_norms]
        for proj, rows, kind in (("q", q_size, "mixing"), ("k", kv_size, "mixing"), ("v", kv_size, "linear")):
            specs.append((p + f"self_attn.{proj}_proj.weight", (rows, hidden), kind))
            if qkv_bias:
                specs.append((p + f"self_attn.{proj}_proj.bias", (rows,), "bias"))
        specs.append((p + "self_attn.o_proj.weight", (hidden, q_size), "mixing"))
        if config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"):
            specs += [
                (p + "self_attn.q_norm.weight", (head_dim,), norm),
                (p + "self_attn.k_norm.weight", (head_dim,), norm),
            ]
        if _is_sparse_layer(config, i):
            specs += _moe_specs(config, p)
        else:
            specs += _mlp_specs(p + "mlp.", hidden, inter)
    specs.append(("model.norm.weight", (hidden,), "offset_final_norm" if gemma else "final_norm"))
    if not config["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (config["vocab_size"], hidden), "head"))
    return specs


def _mlp_specs(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (prefix + "gate_proj.weight", (inter, hidden), "linear"),
        (prefix + "up_proj.weight", (inter, hidden), "linear"),
        (prefix + "down_proj.weight", (hidden, inter), "mixing"),
    ]


def _is_sparse_layer(config: dict[str, Any], index: int) -> bool:
    if config["model_type"] == "mixtral":
        return True
    if config["model_type"] not in ("qwen2_moe", "qwen3_moe"):
        return False
    return index not in config["mlp_only_layers"] and (index + 1) % config["decoder_sparse_step"] == 0


def _moe_specs(config: dict[str, Any], prefix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """A sparse block under its checkpoint names: the router, each expert, Qwen2-MoE's shared expert."""
    hidden = config["hidden_size"]
    if config["model_type"] == "mixtral":
        block, experts, inter = prefix + "block_sparse_moe.", config["num_local_experts"], config["intermediate_size"]
    else:
        block, experts, inter = prefix + "mlp.", config["num_experts"], config["moe_intermediate_size"]
    specs: list[tuple[str, tuple[int, ...], str]] = [(block + "gate.weight", (experts, hidden), "router")]
    for e in range(experts):
        expert = f"{block}experts.{e}."
        if config["model_type"] == "mixtral":
            specs += [
                (expert + "w1.weight", (inter, hidden), "linear"),
                (expert + "w2.weight", (hidden, inter), "mixing"),
                (expert + "w3.weight", (inter, hidden), "linear"),
            ]
        else:
            specs += _mlp_specs(expert, hidden, inter)
    if config.get("shared_expert_intermediate_size"):
        specs += _mlp_specs(block + "shared_expert.", hidden, config["shared_expert_intermediate_size"])
        specs.append((block + "shared_expert_gate.weight", (1, hidden), "linear"))
    return specs


# ---- tokenizer ----


def corpus_text() -> str:
    return resources.files("tritonllm.checkpoints").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")


# The pre-tokenizer split of Qwen2-family tokenizers (digits one by one). transformers 5 imposes it on any
# model_type "qwen2" folder whatever tokenizer.json says, so every tiny model uses it and all loaders agree.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """A byte-level BPE (any UTF-8 text encodes, nothing is unknown) trained on the shipped corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=1,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    return tokenizer.to_str(pretty=True)


def _tokenizer_config() -> dict[str, Any]:
    added = {
        str(i): dict(content=token, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return portable_tokenizer_config(
        dict(
            added_tokens_decoder=added,
            bos_token=None,
            eos_token=EOS_TOKEN,
            pad_token=PAD_TOKEN,
            unk_token=None,
            model_max_length=MAX_POSITION_EMBEDDINGS,
        ),
        chat_template=CHATML_TEMPLATE,
    )
