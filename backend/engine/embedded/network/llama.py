"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; so also SmolLM2 and TinyLlama) over the paged KV cache;
Phi-3, the mixtures of experts and Gemma build on it.

Tokens of all sequences in a step are one flat batch `[T, ...]`; `AttentionMetadata` says which belong together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention, triton_backend
from ..attention.kv_store import RotaryStore
from .cpu_gemm import pack_weight, packed_linear
from .layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding, rotate
from .model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
_FEW_ROWS = 16


@dataclass
class WeightSlot:
    """Where one checkpoint tensor goes: rows `start : start + shape[0]` of `param` (fused projections)."""

    param: nn.Parameter
    start: int
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, param: nn.Parameter) -> "WeightSlot":
        return cls(param, 0, tuple(param.shape))

    def copy_(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.param.narrow(0, self.start, self.shape[0]).copy_(tensor)


class LlamaAttention(nn.Module):
    fused = False  # rotary embedding in place, in one kernel (layers.use_fused_kernels)
    rotary_in_qkv = False  # a one-row int4 qkv_proj rotates and stores k and v itself (quant/fusion.py sets it)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.split_sizes = [config.q_size, config.kv_size, config.kv_size]
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, sum(self.split_sizes), bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # This layer's attention window (attention/windows.py), None for full attention; a constant once loaded,
        # so CUDA graphs capture it.
        self.window: int | None = None
        # The FP8 KV cache's scales of this layer (attention/fp8_cache.py): 1.0, or the checkpoint's (kv_scales.py);
        # constants once loaded, like the window.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.softcap: float | None = None  # attention logits capped at cap * tanh(s / cap) (Gemma 2), else None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache,
        lora=None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual`: for an o_proj that folds the norm after it (quant/norm_fold.py)."""
        tokens = hidden.shape[0]
        # Fused on the Triton backend, queries and keys may rotate in the KV store's launch (one kernel fewer);
        # read at each call, so that tests can switch it.
        rotate_later = self.fused and attn.kernel is not None and triton_backend.ROTATE_WHILE_STORING
        store = None
        if rotate_later and self.rotary_in_qkv and tokens == 1 and lora is None:
            store = self._rotary_store(cos, sin, attn, kv_cache)
        if store is None:
            q, k, v = self._queries_keys_values(hidden, cos, sin, lora, rotate_later)
        else:  # qkv_proj rotates q and k and stores k and v itself (quant/qkv_rotary.py): attention only reads
            q, k, v = self.qkv_proj(hidden, rotary=store).split(self.split_sizes, dim=-1)
            q = q.view(tokens, self.num_heads, self.head_dim)
            k, v = (t.view(tokens, self.num_kv_heads, self.head_dim) for t in (k, v))
        rotary = (cos, sin) if rotate_later and store is None else None
        out = paged_attention(
            q,
            k,
            v,
            *kv_cache,
            attn,
            self.scale,
            self.window,
            self.softcap,
            self.k_scale,
            self.v_scale,
            rotary=rotary,
            stored=store is not None,
        ).reshape(tokens, -1)
        projected = self.o_proj(out) if residual is None else self.o_proj(out, residual=residual)
        return projected if lora is None else lora.apply("o", out, projected)

    def _queries_keys_values(self, hidden, cos, sin, lora, rotate_later: bool):
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] of qkv_proj (plus LoRA), q and k rotated here
        unless the KV store rotates them (rotate_later)."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.apply("qkv", hidden, qkv)
        q_and_k, v = qkv.split([self.split_sizes[0] + self.split_sizes[1], self.split_sizes[2]], dim=-1)
        q_and_k = q_and_k.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3 normalises each head before rotating it
            q, k = q_and_k.split([self.num_heads, self.num_kv_heads], dim=1)
            q_and_k = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        if not rotate_later:  # queries and keys rotate in one go (fewer small ops per layer, which count on CPU)
            q_and_k = rotate(q_and_k, cos, sin, self.fused)
        q, k = q_and_k.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v

    def _rotary_store(self, cos, sin, attn: AttentionMetadata, kv_cache: KVCache) -> RotaryStore:
        """What qkv_proj needs to rotate q and k and store k and v itself (kv_store.RotaryStore)."""
        assert attn.kernel is not None  # (the caller's rotate_later)
        slots = attn.kernel.slot_mapping
        return RotaryStore(cos, sin, *kv_cache, slots, self.k_scale, self.v_scale, self.num_heads, self.num_kv_heads)


class LlamaDecoderLayer(nn.Module):
    folds_norms = False  # o_proj and down_proj begin the norms after them (quant/norm_fold.py; fusion.py sets it)

    def __init__(self, config: ModelConfig, mlp: nn.Module | None = None):
        """`mlp`: what follows attention in place of the dense GatedMLP (a mixture-of-experts block, moe.py)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias) if mlp is None else mlp
        )

    def forward(self, hidden, cos, sin, attn: AttentionMetadata, kv_cache: KVCache, lora=None) -> torch.Tensor:
        """The layer's output: its input plus the attention's and the MLP's."""
        mlp_out, residual = self.deferred(hidden, None, cos, sin, attn, kv_cache, lora)
        return residual + mlp_out

    def deferred(self, delta, residual, cos, sin, attn: AttentionMetadata, kv_cache: KVCache, lora=None):
        """The layer on the input `delta + residual` (`delta` alone if residual is None), each residual add folded
        into the norm after it: returns (the MLP's output, input + the attention's), whose sum is the layer's
        output, for the next layer's (or the final) norm to add."""
        if residual is None:
            normed, residual = self.input_layernorm(delta), delta
        else:
            normed, residual = self.input_layernorm(delta, residual=residual)
        fold = {"residual": residual} if self.folds_norms else {}
        attended = self.self_attn(normed, cos, sin, attn, kv_cache, lora, **fold)
        normed, residual = self.post_attention_layernorm(attended, residual=residual)
        fold = {"residual": residual} if self.folds_norms else {}
        return self.mlp(normed, lora, **fold), residual


class LlamaForCausalLM(nn.Module):
    # The final norm's class: a family with its own RMSNorm (Gemma's 1 + weight, network/gemma.py) swaps it in.
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.build_layer(config, i) for i in range(config.num_layers))
        self.set_attention_windows(config.layer_windows or (None,) * config.num_layers)  # the checkpoint's own
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)
        # Tied models reuse the embedding matrix as the output projection.
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_head: torch.Tensor | None = None
        # Layers whose outputs `forward` also returns (EAGLE-3 drafts read them), in ascending order.
        self.capture_layers: tuple[int, ...] = ()

    def build_layer(self, config: ModelConfig, index: int) -> nn.Module:
        """Decoder layer `index`: families with other MLPs (moe.py) or other layers (gemma.py) override this; a
        layer has LlamaDecoderLayer's parts (NormedDecoderLayer) and its `deferred`."""
        return LlamaDecoderLayer(config)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """Every RoPE the model rotates with (Gemma 3 has a second one for its sliding layers): the loader and the
        engine reset them all."""
        return [module for module in self.modules() if isinstance(module, RotaryEmbedding)]

    def pack_for_cpu(self, head: bool = True) -> None:
        """Prepack every projection and (with `head`: not on a pipeline stage without one) the output head for CPU
        matmuls (fp32 on CPU only; see cpu_gemm). Costs a second copy of those weights in memory; call once the
        weights are loaded."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        if head:
            self.packed_head = pack_weight(self.output_weight)

    def set_attention_windows(self, windows: Sequence[int | None]) -> None:
        """One window (or None) per layer, before the first forward (and before CUDA graphs capture one); the
        engine sets the checkpoint's combined with kv_cache_config.max_attention_window (attention/windows.py)."""
        if len(windows) != len(self.layers):
            raise ValueError(f"got {len(windows)} attention windows for {len(self.layers)} layers")
        for layer, window in zip(self.decoder_layers, windows):
            layer.self_attn.window = window

    @property
    def decoder_layers(self) -> Iterable[LlamaDecoderLayer]:
        """`layers`, typed: a ModuleList hands out plain Modules."""
        return cast(Iterable[LlamaDecoderLayer], self.layers)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
        lora=None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: one (k, v) per layer. Returns final-norm hidden states [T, hidden],
        followed along the last dimension by the outputs of `capture_layers` if any ([T, hidden * (1 + layers)]: one
        tensor, so that a CUDA graph's output holds them too). `lora`: the step's multi-LoRA view
        (tritonllm.lora.layers.LoraBatch), or None for the base model."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden, residual = self.embed(input_ids), None
        rotations = self.layer_rotations(positions, hidden.dtype)
        captured = []
        for index, (layer, kv_cache, (cos, sin)) in enumerate(zip(self.decoder_layers, kv_caches, rotations)):
            hidden, residual = layer.deferred(
                hidden, residual, cos, sin, attn, kv_cache, None if lora is None else lora.layer(index)
            )
            if index in self.capture_layers:
                captured.append(residual + hidden)
        normed = self.norm(hidden) if residual is None else self.norm(hidden, residual=residual)[0]
        return torch.cat([normed] + captured, dim=-1) if captured else normed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input (Gemma scales it)."""
        return self.embed_tokens(input_ids)

    def layer_rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's RoPE (cos, sin) at `positions`: the same for all (Gemma 3's sliding layers have their own)."""
        return [self.rotary_emb(positions, dtype)] * len(self.layers)

    def compute_logits(self, hidden: torch.Tensor, cast: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab]. cast False: in the head's own dtype where no fp32
        arithmetic follows the head (a plain greedy step reads them as they are: sampler.greedy_choices)."""
        if self.packed_head is not None:
            logits = packed_linear(hidden, self.packed_head, None)
        elif 1 < hidden.shape[0] <= _FEW_ROWS and hidden.device.type == "cpu":
            # A few rows (speculative drafts, small decode batches): on CPU, weight @ hidden.T runs at the cost of one
            # row where the usual layout costs several (measured on SmolLM2's 49k x 576 head).
            logits = (self.output_weight @ hidden.t()).t()
        else:
            logits = F.linear(hidden, self.output_weight)
        return logits.float() if cast else logits

    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        """Every tensor a Hugging Face checkpoint of this model must hold, by its HF name."""
        slots = {
            "model.embed_tokens.weight": _whole(self.embed_tokens.weight),
            "model.norm.weight": _whole(self.norm.weight),
        }
        if self.lm_head is not None:
            slots["lm_head.weight"] = _whole(self.lm_head.weight)
        for i, layer in enumerate(self.decoder_layers):
            slots.update(self.layer_slots(f"model.layers.{i}.", layer))
        return slots

    def layer_slots(self, prefix: str, layer: LlamaDecoderLayer) -> dict[str, WeightSlot]:
        return layer_slots(prefix, layer)


def _whole(param: nn.Parameter) -> WeightSlot:
    return WeightSlot.whole(param)


def _stacked(param: nn.Parameter, sizes: list[int]) -> list[WeightSlot]:
    """Slots for checkpoint tensors stacked along dim 0 into one fused parameter."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [WeightSlot(param, start, (size, *param.shape[1:])) for start, size in zip(starts, sizes)]


class DecoderLayerParts(Protocol):
    """What the checkpoint slot map and EAGLE training read of a decoder layer past its input norm:
    LlamaDecoderLayer, EAGLE's draft layer (whose input norm is an identity) and EAGLE-3's midlayer."""

    @property
    def self_attn(self) -> LlamaAttention: ...

    @property
    def post_attention_layernorm(self) -> RMSNorm: ...

    @property
    def mlp(self) -> nn.Module: ...


class NormedDecoderLayer(DecoderLayerParts, Protocol):
    """A decoder layer with its input norm (LlamaDecoderLayer, EAGLE-3's midlayer)."""

    @property
    def input_layernorm(self) -> RMSNorm: ...


def layer_slots(prefix: str, layer: NormedDecoderLayer) -> dict[str, WeightSlot]:
    """Where each checkpoint tensor of one decoder layer (names under `prefix`) goes; EAGLE-3's draft layer too."""
    return {
        prefix + "input_layernorm.weight": _whole(layer.input_layernorm.weight),
        **layer_slots_without_input_norm(prefix, layer),
    }


def layer_slots_without_input_norm(prefix: str, layer: DecoderLayerParts) -> dict[str, WeightSlot]:
    """layer_slots but for the input norm (EAGLE's draft layer has none)."""
    if not isinstance(layer.mlp, GatedMLP):
        raise TypeError(f"{prefix}mlp is a {type(layer.mlp).__name__}, not a dense GatedMLP")
    return {**attention_slots(prefix, layer), **mlp_slots(prefix + "mlp.", layer.mlp)}


def attention_slots(prefix: str, layer: DecoderLayerParts) -> dict[str, WeightSlot]:
    """The attention's tensors and the norm after it, of one decoder layer."""
    attn = layer.self_attn
    slots = {
        prefix + "post_attention_layernorm.weight": _whole(layer.post_attention_layernorm.weight),
        prefix + "self_attn.o_proj.weight": _whole(attn.o_proj.weight),
    }
    _add_stacked(slots, [prefix + f"self_attn.{p}_proj" for p in "qkv"], attn.qkv_proj, attn.split_sizes)
    if attn.o_proj.bias is not None:
        slots[prefix + "self_attn.o_proj.bias"] = _whole(attn.o_proj.bias)
    if attn.q_norm is not None and attn.k_norm is not None:
        slots[prefix + "self_attn.q_norm.weight"] = _whole(attn.q_norm.weight)
        slots[prefix + "self_attn.k_norm.weight"] = _whole(attn.k_norm.weight)
    return slots


def mlp_slots(prefix: str, mlp: GatedMLP) -> dict[str, WeightSlot]:
    """A dense gated MLP's tensors, named `prefix` + gate_proj / up_proj / down_proj."""
    slots = {prefix + "down_proj.weight": _whole(mlp.down_proj.weight)}
    _add_stacked(slots, [prefix + "gate_proj", prefix + "up_proj"], mlp.gate_up_proj, [mlp.intermediate_size] * 2)
    if mlp.down_proj.bias is not None:
        slots[prefix + "down_proj.bias"] = _whole(mlp.down_proj.bias)
    return slots


def _add_stacked(slots: dict[str, WeightSlot], names: list[str], linear: Linear, sizes: list[int]) -> None:
    for kind in ("weight", "bias"):
        param = getattr(linear, kind)
        if param is not None:
            slots.update({f"{name}.{kind}": slot for name, slot in zip(names, _stacked(param, sizes))})
