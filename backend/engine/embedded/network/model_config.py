"""The model facts the embedded engine needs, parsed once from a Hugging Face `config.json` into a typed object.

Reads both config dialects: transformers 4.x (`rope_theta` at the top level, `rope_scaling`) and 5.x
(`rope_parameters`, `dtype`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, TypedDict, Union

import torch


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file, tensor or setting at fault."""


# HF architecture name -> its `model_type`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# RoPE types a family accepts where it is narrower than SUPPORTED_ROPE_TYPES (as transformers validates them);
# longrope is checked against transformers on Phi-3 only.
_FAMILY_ROPE_TYPES = {"phi3": ("default", "longrope")}
_GENERAL_ROPE_TYPES = tuple(t for t in SUPPORTED_ROPE_TYPES if t != "longrope")
DEFAULT_ROPE_THETA = 10000.0
GEMMA_TYPES = ("gemma2", "gemma3_text")


@dataclass
class RopeConfig:
    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    # The type's own settings (factor, low_freq_factor, beta_fast, ...), as written in the config.
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class MoeConfig:
    """The mixture-of-experts settings: each token goes to `top_k` of `num_experts` gated SiLU MLPs, chosen by a
    softmax router, their outputs weighted by the router's probabilities."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1 (Mixtral always)
    # Per layer: True where the MLP is the sparse block, False where it is a dense MLP (Qwen's mlp_only_layers).
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    # Mixtral weighs expert outputs with fp32 router probabilities; Qwen rounds them to the model's dtype first.
    fp32_router_weights: bool = False


@dataclass
class GemmaSettings:
    """What Gemma 2 / 3 add to a Llama-shaped config."""

    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: Optional[float]  # Gemma 2: scores = cap * tanh(scores / cap) before the softmax
    final_logit_softcapping: Optional[float]  # the same on the output logits
    local_rope: Optional[RopeConfig]  # Gemma 3: the RoPE of sliding layers (the global one is ModelConfig.rope)


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    # Set only when the checkpoint really uses sliding-window attention (on some layer, see layer_windows).
    sliding_window: Optional[int] = None
    # Each layer's window as transformers applies it (None: full attention); empty without sliding layers.
    layer_windows: tuple[Optional[int], ...] = ()
    eos_token_id: Union[int, list[int], None] = None
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    torch_dtype: Optional[str] = None  # as written in config.json (`torch_dtype` or `dtype`); may be None
    moe: Optional[MoeConfig] = None  # set for mixture-of-experts families (MOE_MODEL_TYPES)
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_pytorch_tanh (Gemma)
    # Each layer's kind as transformers names it (sliding_attention / full_attention); set for Gemma, whose
    # sliding layers also take their own RoPE (Gemma 3).
    layer_types: tuple[str, ...] = ()
    gemma: Optional["GemmaSettings"] = None  # Gemma 2 / 3 only
    # The checkpoint's own quantization (config.json's quantization_config), as written; quant/settings.py reads it.
    quantization_config: Optional[dict[str, Any]] = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache that one token takes over all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        return _parse(raw, source)


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    architecture = _architecture(raw, source)
    model_type = SUPPORTED_ARCHITECTURES[architecture]
    hidden = _required(raw, "hidden_size", source)
    heads = _required(raw, "num_attention_heads", source)
    num_layers = _required(raw, "num_hidden_layers", source)
    gemma = model_type in GEMMA_TYPES
    hidden_act = _gemma_activation(raw, source) if gemma else _check_activation(raw, source)
    # Qwen3 configs that leave head_dim out mean 128 (Gemma's 256), not hidden / heads.
    default_head_dim = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256}.get(model_type, hidden // heads)
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    config = ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=_required(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_required(raw, "intermediate_size", source),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=raw.get("head_dim") or default_head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        # transformers' Gemma configs tie by default (gemma-2-2b's config.json leaves the key out)
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        rope=_gemma3_ropes(raw, source)[0] if model_type == "gemma3_text" else _rope(raw, model_type, source),
        layer_windows=_layer_windows(raw, model_type, num_layers, source),
        eos_token_id=raw.get("eos_token_id"),
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantization_config=raw.get("quantization_config"),
        moe=_moe(raw, model_type, num_layers, source) if model_type in MOE_MODEL_TYPES else None,
        hidden_act=hidden_act,
        **_bias_flags(raw, model_type),
    )
    if gemma:
        _add_gemma(config, raw, source)
    config.sliding_window = max((w for w in config.layer_windows if w), default=None)
    return config


def _architecture(raw: dict[str, Any], source: str) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if names:
        raise ModelLoadError(
            f"{source}: unsupported architecture {', '.join(map(str, names))}; the embedded engine supports {supported}"
        )
    # No `architectures` list: fall back on model_type.
    model_type = raw.get("model_type")
    for name, known_type in SUPPORTED_ARCHITECTURES.items():
        if model_type == known_type:
            return name
    raise ModelLoadError(
        f"{source}: unsupported model_type {model_type!r} (no architectures listed); "
        f"the embedded engine supports {supported}"
    )


def _required(raw: dict[str, Any], key: str, source: str) -> Any:
    if raw.get(key) is None:
        raise ModelLoadError(f"{source}: required setting {key!r} is missing")
    return raw[key]


def _check_activation(raw: dict[str, Any], source: str) -> str:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    return act


def _gemma_activation(raw: dict[str, Any], source: str) -> str:
    # transformers' Gemma 2 / 3 read `hidden_activation` (older configs also carry a `hidden_act`, unused).
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    return act


class _BiasFlags(TypedDict):
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


def _bias_flags(raw: dict[str, Any], model_type: str) -> _BiasFlags:
    attention_bias = bool(raw.get("attention_bias", False))
    if model_type == "qwen2":  # Qwen2 always has q/k/v biases and no o_proj bias
        return _BiasFlags(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
    if model_type in ("qwen3", "qwen3_moe"):
        return _BiasFlags(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=True)
    if model_type == "qwen2_moe":  # q/k/v biases unless `qkv_bias` turns them off
        return _BiasFlags(qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False, mlp_bias=False, qk_norm=False)
    if model_type in GEMMA_TYPES:  # Gemma 3 normalises each head of q and k before RoPE, as Qwen3
        return _BiasFlags(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=model_type == "gemma3_text"
        )
    if model_type in ("mistral", "mixtral", "phi3"):  # none has a bias anywhere, whatever the config says
        return _BiasFlags(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    return _BiasFlags(
        qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=False
    )


def _rope(raw: dict[str, Any], model_type: str, source: str) -> RopeConfig:
    # transformers 5.x gives `rope_scaling` precedence over `rope_parameters` when both are present.
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # early Phi-3 configs' names for it, which transformers reads as longrope
    allowed = _FAMILY_ROPE_TYPES.get(model_type, _GENERAL_ROPE_TYPES)
    if rope_type not in allowed:
        supported = ", ".join(allowed)
        raise ModelLoadError(
            f"{source}: RoPE type {rope_type!r} is not supported for {model_type}; supported types: {supported}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial} is not supported (only 1.0)")
    params.pop("partial_rotary_factor", None)
    if rope_type in ("llama3", "yarn", "longrope"):
        # Scaled types measure against the pre-training context, which defaults to max_position_embeddings.
        params.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
        )
    if rope_type == "longrope":
        _check_longrope(params, raw, source)
    return RopeConfig(rope_type=rope_type, theta=float(theta), params=params)


def _check_longrope(params: dict[str, Any], raw: dict[str, Any], source: str) -> None:
    """Both factor lists, one number per rotated pair (transformers measures the pairs as hidden / heads / 2); a
    missing `factor` is the context's stretch, max_position_embeddings / original_max_position_embeddings."""
    pairs = raw["hidden_size"] // raw["num_attention_heads"] // 2
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if (
            not isinstance(factors, list)
            or len(factors) != pairs
            or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)
        ):
            raise ModelLoadError(f"{source}: rope_scaling.{key} must be a list of {pairs} positive numbers")
    original = params["original_max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelLoadError(f"{source}: original_max_position_embeddings must be a positive integer, got {original!r}")
    if params.get("factor") is None:
        params["factor"] = raw.get("max_position_embeddings", 2048) / original


def _layer_windows(raw: dict[str, Any], model_type: str, num_layers: int, source: str) -> tuple[Optional[int], ...]:
    """Per layer, the window transformers gives it: Mistral slides on every layer (its class default 4096 when
    the key is absent; null turns it off, and transformers ignores a Mistral `layer_types`); Qwen2 / Qwen3 only with
    `use_sliding_window`, on the layers `layer_types` calls sliding_attention or else those at index >=
    `max_window_layers`; Llama has none, but a config that sets one anyway is honoured on every layer, and so does
    Phi-3 (transformers applies its `sliding_window` to every layer whenever it is set); Gemma slides on the layers
    its `layer_types` (or their default pattern) call sliding_attention, 4096 by default."""
    if model_type == "mistral":
        window = raw.get("sliding_window", 4096)
        sliding = [True] * num_layers
    elif model_type == "qwen3_moe":  # transformers slides on every layer once use_sliding_window is set
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
        sliding = [True] * num_layers
    elif model_type == "qwen2_moe":
        if raw.get("use_sliding_window", False):
            raise ModelLoadError(f"{source}: use_sliding_window is not supported for Qwen2-MoE")
        return ()
    elif model_type in GEMMA_TYPES:
        window = raw.get("sliding_window", 4096)
        sliding = [kind == "sliding_attention" for kind in _gemma_layer_types(raw, model_type, num_layers, source)]
    elif model_type in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window", False):
            return ()
        window = raw.get("sliding_window", 4096)
        layer_types = raw.get("layer_types")
        if layer_types is None:
            first_sliding = raw.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
        sliding = [kind == "sliding_attention" for kind in layer_types]
    else:
        window = raw.get("sliding_window")
        sliding = [True] * num_layers
    if not window or not any(sliding):  # null (or 0, as older configs write "off")
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    return tuple(window if slides else None for slides in sliding)


def _moe(raw: dict[str, Any], model_type: str, num_layers: int, source: str) -> MoeConfig:
    """Mixtral: `num_local_experts` experts of `intermediate_size` on every layer, top-k renormalised. Qwen-MoE:
    `num_experts` of `moe_intermediate_size`, `norm_topk_prob`, sparse on the layers (i + 1) %
    `decoder_sparse_step` == 0 not in `mlp_only_layers`; Qwen2-MoE adds a shared expert."""
    if model_type == "mixtral":
        experts_key, size_key = "num_local_experts", "intermediate_size"
    else:
        experts_key, size_key = "num_experts", "moe_intermediate_size"
    num_experts = _positive(raw, experts_key, _required(raw, experts_key, source), source)
    top_k = _positive(raw, "num_experts_per_tok", raw.get("num_experts_per_tok", 2), source)
    if top_k > num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({top_k}) exceeds {experts_key} ({num_experts})")
    step = _positive(raw, "decoder_sparse_step", raw.get("decoder_sparse_step", 1), source)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ModelLoadError(f"{source}: mlp_only_layers must be a list of layer indices, got {dense!r}")
    shared = 0
    if model_type == "qwen2_moe":
        key = "shared_expert_intermediate_size"
        shared = _positive(raw, key, _required(raw, key, source), source)
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=_positive(raw, size_key, _required(raw, size_key, source), source),
        norm_topk_prob=model_type == "mixtral" or bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=shared,
        fp32_router_weights=model_type == "mixtral",
    )


def _positive(raw: dict[str, Any], key: str, value: Any, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


# ---- Gemma 2 / 3 ----


def _gemma_layer_types(raw: dict[str, Any], model_type: str, num_layers: int, source: str) -> tuple[str, ...]:
    """`layer_types`, else transformers' default: every `pattern`-th layer global, the others sliding (Gemma 2:
    2, so even layers slide; Gemma 3: `sliding_window_pattern`, 6 by default: 5 local to 1 global)."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = 2 if model_type == "gemma2" else raw.get("sliding_window_pattern", 6)
        pattern = _positive(raw, "sliding_window_pattern", pattern, source)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    known = ("sliding_attention", "full_attention")
    if len(layer_types) != num_layers or any(kind not in known for kind in layer_types):
        raise ModelLoadError(
            f"{source}: layer_types must list {num_layers} entries, each one of {', '.join(known)}; got {layer_types!r}"
        )
    return tuple(layer_types)


def _gemma3_ropes(raw: dict[str, Any], source: str) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE of Gemma 3. transformers 5.x writes `rope_parameters` keyed by layer type; 4.x wrote
    `rope_theta` (global, 1e6 by default) with `rope_scaling` (global layers only) and `rope_local_base_freq`
    (1e4 by default)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    context = {"max_position_embeddings": raw.get("max_position_embeddings")}
    return (
        _rope({**context, "rope_parameters": full}, "gemma3_text", source),
        _rope({**context, "rope_parameters": local}, "gemma3_text", source),
    )


def _add_gemma(config: ModelConfig, raw: dict[str, Any], source: str) -> None:
    if raw.get("text_config") is not None:
        raise ModelLoadError(f"{source}: text_config (a multimodal Gemma 3) is not supported; give the text model")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported (only causal attention)")
    gemma3 = config.model_type == "gemma3_text"
    config.layer_types = _gemma_layer_types(raw, config.model_type, config.num_layers, source)
    # Absent keys take transformers' class defaults: Gemma 2 caps logits (50 / 30), Gemma 3 does not.
    defaults = (None, None) if gemma3 else (50.0, 30.0)
    config.gemma = GemmaSettings(
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping, whatever the config says.
        attn_logit_softcapping=None
        if gemma3
        else _positive_or_none(raw, "attn_logit_softcapping", defaults[0], source),
        final_logit_softcapping=_positive_or_none(raw, "final_logit_softcapping", defaults[1], source),
        local_rope=_gemma3_ropes(raw, source)[1] if gemma3 else None,
    )


def _positive_or_none(raw: dict[str, Any], key: str, default: Optional[float], source: str) -> Optional[float]:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelLoadError(f"{source}: {key} must be a positive number or null, got {value!r}")
    return float(value)
