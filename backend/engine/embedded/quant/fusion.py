"""Where the kernel before an FP8 projection quantizes its input (network/fused_ops.py's FP8 rows), and where
one-row int4 projections take over the norms between them (norm_fold.py) and gate_up the SiLU (gate_up_runs.py).

A projection with dynamic per-token FP8 scales quantizes its input in a launch of its own (fp8_kernel.py) that
reads the activations again. Where that input is a fused RMSNorm's output (qkv_proj, gate_up_proj) or the fused
SiLU's (down_proj), the norm or the SiLU writes the FP8 rows beside its output instead, with the values the
projection's own quantizer would give. o_proj's input, the attention output, keeps the separate launch. Only on a
GPU with FP8 matmuls (elsewhere fp8_linear dequantizes, and the rows would go unread)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..network.layers import GatedMLP, RMSNorm
from ..network.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from .gate_up_runs import reorder_rows
from .kernels import fp8_supported, int4_folds, int4_gate_up_runs, int4_one_row_applies, int4_rotates
from .linear import QuantLinear
from .norm_fold import NormFold, ring

log = logging.getLogger("tritonllm.engine")
FP8_ROWS = True  # False: every FP8 projection quantizes its input itself (for comparisons)
DEFER_SCALES = True  # False: every FP8 projection scales its own output (for comparisons)
# Batch-1 W4A16 decode with the norms folded into the int4 GEMVs around them (norm_fold.py): 410-412 against 399
# tok/s on an H200 (docs/benchmarks.md, twenty-ninth session). False: every norm its own launch (for comparisons).
FOLD_NORMS = True
# With the norms folded, gate_up's one-row GEMV also applies the SiLU (gate_up_runs.py: its rows reordered at
# load), a launch fewer a layer. Off until an H200 run has timed it.
SILU_IN_GATE_UP = False
# With the norms folded, qkv_proj's one-row GEMV also rotates q and k and stores k and v into the caches
# (qkv_rotary.py), a launch fewer a layer: +2.4-2.8% for W4A16 at batch 1 on H100s (thirty-fifth and thirty-sixth
# sessions, docs/benchmarks.md), its kernel and greedy-token tests passing there.
ROTARY_IN_QKV = True


def takes_fp8_rows(projection: object) -> bool:
    """An FP8 projection with dynamic (per-token) activation scales."""
    return isinstance(projection, QuantLinear) and projection.kind == "fp8" and not projection.static_input


def _fusable_norm(norm: object) -> bool:
    return type(norm) is RMSNorm and norm.fused  # OffsetRMSNorm (Gemma) has no fused kernel


def hand_fp8_rows(model: nn.Module, device: torch.device) -> int:
    """Mark the fused norms and SiLUs of `model` that feed FP8 projections (after use_fused_kernels); returns how
    many producers were marked."""
    if not FP8_ROWS or not fp8_supported(device):
        return 0
    marked = 0
    for layer in getattr(model, "decoder_layers", ()):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        pairs = [
            (getattr(layer, "input_layernorm", None), getattr(attn, "qkv_proj", None)),
            (getattr(layer, "post_attention_layernorm", None), getattr(mlp, "gate_up_proj", None)),
        ]
        for norm, projection in pairs:
            if _fusable_norm(norm) and takes_fp8_rows(projection):
                norm.fp8_rows = True  # type: ignore[union-attr]
                marked += 1
        if isinstance(mlp, GatedMLP) and mlp.fused and mlp.activation == "silu" and takes_fp8_rows(mlp.down_proj):
            mlp.fp8_rows = True
            marked += 1
    if marked:
        log.info("FP8 activations: %d norms and SiLUs quantize their outputs for the projections after them", marked)
    return marked


def defer_fp8_scales(model: nn.Module, device: torch.device, lora_enabled: bool) -> int:
    """Let each FP8 o_proj and down_proj whose output only a fused RMSNorm reads (the next norm's residual add)
    leave its scales to that norm (kernels.fp8_linear's defer_scales). Only Llama's own data flow qualifies, and
    not with LoRA (its deltas add to the projection's output) or captured layers (EAGLE-3 reads layer outputs).
    Call once the speculator is built; returns how many projections were marked."""
    if not DEFER_SCALES or lora_enabled or not fp8_supported(device) or not _llama_flow(model):
        return 0
    assert isinstance(model, LlamaForCausalLM)
    layers = list(model.decoder_layers)
    next_norms = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
    marked = []
    for layer, next_norm in zip(layers, next_norms):
        if type(layer).deferred is not LlamaDecoderLayer.deferred:
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn).forward is LlamaAttention.forward:
            marked.append(_deferring(attn.o_proj, layer.post_attention_layernorm))
        if type(mlp) is GatedMLP:
            marked.append(_deferring(mlp.down_proj, next_norm))
    for projection in filter(None, marked):
        projection.defer_scales = True
    count = sum(1 for projection in marked if projection is not None)
    if count:
        log.info("FP8 projections: %d leave their scales to the norm after them at decode sizes", count)
    return count


def _llama_flow(model: nn.Module) -> bool:
    """The model runs LlamaForCausalLM's forward (layer outputs reach only the next norm) and captures nothing."""
    return type(model).forward is LlamaForCausalLM.forward and not getattr(model, "capture_layers", ())


def _deferring(projection: object, reader: object) -> QuantLinear | None:
    """`projection` when it is a bias-free FP8 one whose reader is a fused RMSNorm, else None."""
    if isinstance(projection, QuantLinear) and projection.kind == "fp8" and projection.bias is None:
        return projection if _fusable_norm(reader) else None
    return None


def fold_int4_norms(model: nn.Module, device: torch.device, lora_enabled: bool) -> int:
    """Fold each norm between two int4 projections of a Llama-flow model into them at one-row steps
    (norm_fold.py): on CUDA, without LoRA (its deltas read the normed input and add to the output). Call once
    the speculator is built; returns how many norms fold."""
    if not FOLD_NORMS or lora_enabled or device.type != "cuda" or not _llama_flow(model):
        return 0
    count = install_norm_folds(model, device)
    if count:
        log.info("W4A16: %d norms fold into the one-row int4 projections around them", count)
    if count and SILU_IN_GATE_UP:
        runs = install_gate_up_runs(model)
        log.info("W4A16: %d gate_up projections apply the SiLU in their one-row GEMV", runs)
    if count and ROTARY_IN_QKV:
        rotating = install_qkv_rotary(model)
        log.info("W4A16: %d qkv projections rotate and store keys and values in their one-row GEMV", rotating)
    return count


def install_qkv_rotary(model: nn.Module) -> int:
    """Let each plain Llama layer's int4 qkv_proj rotate q and k and store k and v at one-row steps
    (qkv_rotary.py): where its attention rotates as the Triton backend stores (fused, no per-head norm) and
    its kernel shape holds rotary pairs. Returns how many."""
    count = 0
    for layer in getattr(model, "decoder_layers", ()):
        if not _plain_llama_layer(layer):
            continue
        attn = layer.self_attn
        qkv = attn.qkv_proj
        if not (attn.fused and attn.q_norm is None and type(qkv) is QuantLinear and qkv.kind == "int4"):
            continue
        assert qkv.qweight is not None  # (int4)
        if _unhooked(qkv) and int4_rotates(qkv.qweight, qkv.group_size, qkv.weight_scale.dtype, attn.head_dim):
            attn.rotary_in_qkv = True
            count += 1
    return count


def install_gate_up_runs(model: nn.Module) -> int:
    """Reorder every decoder layer's int4 gate_up rows into runs (gate_up_runs.py) so that its one-row GEMV
    applies the SiLU: all of them, or none where one cannot. Returns how many."""
    plans = [_gate_up_runs_plan(getattr(layer, "mlp", None)) for layer in getattr(model, "decoder_layers", ())]
    ready = [plan for plan in plans if plan is not None]
    if not plans or len(ready) != len(plans):
        return 0
    for projection, runs in ready:
        reorder_gate_up(projection, runs)
    return len(ready)


def reorder_gate_up(projection: QuantLinear, runs: int) -> None:
    """An int4 gate_up's rows in runs of `runs` (gate_up_runs.py), marked so (`gate_up_runs`)."""
    if projection.gate_up_runs:
        raise ValueError("gate_up's rows are already in run order")
    reorder_rows([projection.qweight, projection.weight_scale, projection.weight_zero, projection.bias], runs)
    projection.gate_up_runs = runs


def _gate_up_runs_plan(mlp: object) -> tuple[QuantLinear, int] | None:
    """A dense SiLU MLP's unhooked int4 gate_up projection and the runs its one-row GEMV needs, else None."""
    if type(mlp) is not GatedMLP or mlp.activation != "silu":
        return None
    projection: object = mlp.gate_up_proj
    if not (isinstance(projection, QuantLinear) and projection.kind == "int4" and _unhooked(projection)):
        return None
    assert projection.qweight is not None  # (int4)
    runs = int4_gate_up_runs(projection.qweight, projection.group_size, projection.weight_scale.dtype)
    return (projection, runs) if runs else None


def _unhooked(module: nn.Module) -> bool:
    """No forward hooks (e.g. tensor parallelism's all-reduce) that a fused epilogue would leave out."""
    return not (module._forward_hooks or module._forward_pre_hooks)


def install_norm_folds(model: nn.Module, device: torch.device) -> int:
    """Each o_proj folds the post-attention norm, each down_proj but the last the next layer's input norm: all of
    them, or none where one pair does not qualify (the slots' ring needs every fold of a step). Returns the count."""
    layers = list(getattr(model, "decoder_layers", ()))
    pairs = []  # (producer, the norm after it, the projection that reads that norm) in step order
    for index, layer in enumerate(layers):
        if not _plain_llama_layer(layer):
            return 0
        pairs.append((layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp.gate_up_proj))
        if index + 1 < len(layers):
            following = layers[index + 1]
            pairs.append((layer.mlp.down_proj, following.input_layernorm, following.self_attn.qkv_proj))
    if len(pairs) < 2 or not all(_foldable(*pair) for pair in pairs):
        return 0
    for (producer, norm, _), (sums, stale) in zip(pairs, ring(len(pairs), device)):
        producer.norm_fold = NormFold(norm.weight, norm.eps, sums, stale)
    for layer in layers:
        layer.folds_norms = True
    return len(pairs)


def _plain_llama_layer(layer: object) -> bool:
    return (
        type(layer) is LlamaDecoderLayer
        and type(layer.self_attn) is LlamaAttention
        and type(layer.mlp) is GatedMLP
        and layer.mlp.activation == "silu"
    )


def _foldable(producer: object, norm: object, reader: object) -> bool:
    """An unhooked int4 producer whose one-row kernel folds, a plain RMSNorm, an int4 reader."""
    if not (type(producer) is QuantLinear and producer.kind == "int4" and type(norm) is RMSNorm):
        return False
    if not _unhooked(producer):
        return False
    dtype = norm.weight.dtype
    if not int4_folds(producer.out_features, producer.in_features, producer.group_size, dtype):
        return False
    if not (type(reader) is QuantLinear and reader.kind == "int4"):
        return False
    return int4_one_row_applies(reader.out_features, reader.in_features, reader.group_size, dtype)
