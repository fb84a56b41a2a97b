"""Which projections of a model are quantized, and their replacement by QuantLinear before allocation.

The projections are each decoder layer's qkv_proj, o_proj, and the dense MLP's gate_up_proj and down_proj. The
embedding, lm_head, MoE routers, experts and shared experts stay unquantized (a checkpoint that quantized them is
refused by the loader, naming the tensor)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..network.layers import GatedMLP, Linear
from ..network.llama import LlamaForCausalLM
from ..network.model_config import ModelLoadError
from ..network.phi3 import Phi3ForCausalLM
from .linear import QuantLinear
from .settings import QuantSettings


@dataclass
class Projection:
    parent: nn.Module
    attr: str
    names: list[str]  # the checkpoint's module names of its parts (one, or those fused into it)

    @property
    def linear(self) -> Linear:
        module = getattr(self.parent, self.attr)
        assert isinstance(module, Linear)
        return module


def projections(model: LlamaForCausalLM) -> list[Projection]:
    fused_in_checkpoint = isinstance(model, Phi3ForCausalLM)
    found = []
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"model.layers.{i}."
        attn = prefix + "self_attn."
        qkv = [attn + "qkv_proj"] if fused_in_checkpoint else [attn + f"{p}_proj" for p in "qkv"]
        found += [
            Projection(layer.self_attn, "qkv_proj", qkv),
            Projection(layer.self_attn, "o_proj", [attn + "o_proj"]),
        ]
        if isinstance(layer.mlp, GatedMLP):
            mlp = prefix + "mlp."
            gate_up = [mlp + "gate_up_proj"] if fused_in_checkpoint else [mlp + "gate_proj", mlp + "up_proj"]
            found += [
                Projection(layer.mlp, "gate_up_proj", gate_up),
                Projection(layer.mlp, "down_proj", [mlp + "down_proj"]),
            ]
    return found


def quantize_layout(model: LlamaForCausalLM, settings: QuantSettings) -> int:
    """Replace the projections `settings` quantizes by QuantLinear (call on the meta-device model, before
    allocation); returns how many were replaced."""
    replaced = 0
    for projection in projections(model):
        chosen = [settings.quantizes(name) for name in projection.names]
        if any(chosen) and not all(chosen):
            parts = ", ".join(n for n, c in zip(projection.names, chosen) if not c)
            raise ModelLoadError(
                f"quantization: {parts} is left unquantized but is fused with quantized parts "
                f"({', '.join(projection.names)}); quantize all of them or none"
            )
        if chosen[0]:
            setattr(projection.parent, projection.attr, _quantized(projection, settings))
            replaced += 1
    return replaced


def _quantized(projection: Projection, settings: QuantSettings) -> QuantLinear:
    linear = projection.linear
    rows, cols = linear.weight.shape
    group = settings.group_for(cols)
    if settings.kind != "fp8" and cols % group:
        raise ModelLoadError(
            f"quantization group_size={group} does not divide the {cols} input columns of "
            f"{projection.names[0]}; choose a group_size that divides every projection's input size"
        )
    return QuantLinear(cols, rows, linear.bias is not None, settings.kind, group, settings.static_input)
