"""EAGLE-3 draft layers: the layer, its config, and loading / saving it in the EAGLE-3 checkpoint format (whose
files tritonllm.spec_decode.eagle_format reads and writes).

An EAGLE-3 draft reads the outputs of a few target layers (`capture_layers`, concatenated in ascending layer order),
squeezes them to its hidden size with `fc` ([H, 3 * H_target], no bias), and runs one Llama layer whose attention
takes `cat(input_layernorm(embed(token)), hidden_norm(feature))` ([T, 2H]) while its residual stream carries the
feature alone. Drafted positions feed the layer's own output back as the feature (already H wide: no fc). Unlike
EAGLE-1/2 it has a head of its own, `lm_head(norm(h))` over a smaller draft vocabulary, whose row i proposes target
token `i + d2t[i]`. tritonllm.spec_decode.training.train_eagle3 trains them; none is shipped."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from tritonllm.spec_decode.checkpoint_files import CONFIG_FILE, copy_weights
from tritonllm.spec_decode.eagle_format import (
    D2T_KEY,
    EAGLE3_ARCHITECTURE,
    EAGLE3_IGNORED,
    EAGLE3_LAYER_PREFIX,
    TARGET_ONLY_KEYS,
    capture_config,
    captured_layers,
    draft_to_target,
    read_eagle3_files,
    write_draft_folder,
)

from ..attention import AttentionMetadata
from ..network.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from ..network.llama import LlamaAttention, WeightSlot, layer_slots
from ..network.model_config import ModelConfig, ModelLoadError
from .eagle import model_load_errors


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v read the normed embedding and feature side by side (2H wide)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.qkv_proj = Linear(2 * config.hidden_size, sum(self.split_sizes), bias=config.qkv_bias)


class Eagle3Layer(nn.Module):
    """The `midlayer`: the attributes layer_slots expects (so q/k/v map onto the fused qkv rows), plus hidden_norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, embeds, hidden, cos, sin, attn: AttentionMetadata, kv_cache) -> torch.Tensor:
        both = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        hidden = hidden + self.self_attn(both, cos, sin, attn, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head:
    """The draft's own head, with DraftHead's interface: fp32 scores over the draft vocabulary, and target ids."""

    def __init__(self, draft: "Eagle3Draft"):
        self.norm, self.lm_head, self.draft_to_target = draft.norm, draft.lm_head, draft.draft_to_target

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (the layer's pre-norm output) -> fp32 logits [N, draft vocab]."""
        return self.lm_head(self.norm(hidden)).float()

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[indices]


class Eagle3Draft(nn.Module):
    """fc + the midlayer + the draft's norm and LM head. `forward` returns the pre-norm output, the next feature."""

    draft_to_target: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: ModelConfig, draft_vocab_size: int, capture_layers: Sequence[int], feature_size: int):
        super().__init__()
        self.config = config
        self.capture_layers = tuple(capture_layers)
        self.fc = Linear(feature_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)
        # The target id of each lm_head row; int64, so `.to(dtype)` leaves it alone.
        self.register_buffer("draft_to_target", torch.arange(draft_vocab_size), persistent=False)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """embeds: [T, H]; features: [T, F], the target's captured layers (F != H) or the draft's own output."""
        features = features.to(embeds.dtype)
        hidden = self.fc(features) if features.shape[-1] != self.hidden_size else features
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, attn, kv_cache)

    def make_head(self, target) -> Eagle3Head:
        """The head drafts are scored with (the target's is not used: EAGLE-3 drafts have their own)."""
        return Eagle3Head(self)

    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        """Every weight an EAGLE-3 checkpoint must hold, by its name there (d2t, not a weight: checkpoint_state)."""
        whole = {
            "fc.weight": self.fc.weight,
            EAGLE3_LAYER_PREFIX + "hidden_norm.weight": self.midlayer.hidden_norm.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        slots = {name: WeightSlot(param, 0, tuple(param.shape)) for name, param in whole.items()}
        slots.update(layer_slots(EAGLE3_LAYER_PREFIX, self.midlayer))
        return slots

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The weights and d2t under the EAGLE-3 format's key names."""
        state = {
            name: slot.param.detach().narrow(0, slot.start, slot.shape[0]).contiguous().clone()
            for name, slot in self.checkpoint_slots().items()
        }
        rows = torch.arange(len(self.draft_to_target), device=self.draft_to_target.device)
        state[D2T_KEY] = self.draft_to_target - rows
        return state

    def pack_for_cpu(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()


# ---- config ---------------------------------------------------------------------------------------------------


def parse_eagle3_config(raw: dict[str, Any], source: str) -> tuple[ModelConfig, int]:
    """(layer config, draft vocabulary size) from an EAGLE-3 config.json."""
    config = ModelConfig.from_dict(
        {"num_hidden_layers": 1, **raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}, source=source
    )
    if config.num_layers != 1:
        raise ModelLoadError(f"{source}: num_hidden_layers is {config.num_layers}; an EAGLE-3 draft has one layer")
    return config, int(raw.get("draft_vocab_size") or config.vocab_size)


def default_capture_layers(target_num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's usual choice: an early, a middle and a late layer."""
    return 1, target_num_layers // 2 - 1, target_num_layers - 4


def resolve_capture_layers(requested: Optional[Sequence[int]], target_num_layers: int, where: str) -> tuple[int, ...]:
    """The target layers to capture, ascending: `requested` (the config's or eagle3_layers_to_capture) or the
    default, each distinct and inside the target; at least two, so features never look like the draft's own."""
    if requested is None:
        layers = default_capture_layers(target_num_layers)
        if len(set(layers)) != len(layers) or not all(0 <= layer < target_num_layers for layer in layers):
            raise ModelLoadError(
                f"{where}: the default capture layers {list(layers)} do not fit a target of "
                f"{target_num_layers} layers; set eagle_aux_hidden_state_layer_ids in the "
                f"draft's eagle_config (or eagle3_layers_to_capture)"
            )
        return layers
    layers = tuple(int(layer) for layer in requested)
    outside = [layer for layer in layers if not 0 <= layer < target_num_layers]
    if outside:
        raise ModelLoadError(
            f"{where}: capture layer {outside[0]} is outside the target's layers [0, {target_num_layers})"
        )
    if len(set(layers)) != len(layers) or len(layers) < 2:
        raise ModelLoadError(f"{where}: capture layers {list(layers)} must be at least two distinct target layers")
    return tuple(sorted(layers))


def eagle3_config_for(
    target_config: dict[str, Any], draft_vocab_size: int, capture_layers: Optional[Sequence[int]] = None
) -> dict[str, Any]:
    """An EAGLE-3 config.json for a target's config.json: its sizes, one bias-free Llama layer (for Qwen targets
    too: the draft has no q/k biases or norms)."""
    target = ModelConfig.from_dict(target_config, source="the target's config.json")
    config = {key: value for key, value in target_config.items() if key not in TARGET_ONLY_KEYS}
    config.update(
        architectures=[EAGLE3_ARCHITECTURE],
        model_type="llama",
        num_hidden_layers=1,
        head_dim=target.head_dim,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target.hidden_size,
    )
    if capture_layers is not None:  # the key names the layers whose inputs are these outputs
        config["eagle_config"] = capture_config(capture_layers)
    return config


# ---- checkpoint folder ----------------------------------------------------------------------------------------


def save_eagle3(
    draft: Eagle3Draft,
    out_dir: Union[str, Path],
    config: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    pickle: bool = False,
) -> Path:
    """Write `config.json` and the weights (`model.safetensors`, or `pytorch_model.bin` with `pickle`); d2t stays
    int64 whatever `dtype`."""
    state = {
        key: value.to(dtype) if value.is_floating_point() else value for key, value in draft.checkpoint_state().items()
    }
    return write_draft_folder(out_dir, state, dict(config, draft_vocab_size=len(draft.draft_to_target)), dtype, pickle)


def random_eagle3(
    target_dir: Union[str, Path],
    out_dir: Union[str, Path],
    seed: int = 0,
    draft_vocab_size: Optional[int] = None,
    capture_layers: Optional[Sequence[int]] = None,
) -> Path:
    """An untrained EAGLE-3 folder for the model in `target_dir` (tests, a start for training): weights
    ~ N(0, 1 / fan_in), norms 1, the draft vocabulary a random sorted subset of the target's (all of it by default)."""
    target_config = json.loads((Path(target_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    target = ModelConfig.from_dict(target_config, source="the target's config.json")
    draft_vocab_size = draft_vocab_size or target.vocab_size
    layers = resolve_capture_layers(capture_layers, target.num_layers, str(target_dir))
    config = eagle3_config_for(target_config, draft_vocab_size, capture_layers)
    layer_config, _ = parse_eagle3_config(config, CONFIG_FILE)
    draft = Eagle3Draft(layer_config, draft_vocab_size, layers, len(layers) * target.hidden_size)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1]))
    chosen = torch.randperm(target.vocab_size, generator=generator)[:draft_vocab_size]
    draft.draft_to_target = torch.sort(chosen).values
    return save_eagle3(draft, out_dir, config)


def load_eagle3(
    model_dir: Union[str, Path],
    dtype: torch.dtype,
    device: Union[str, torch.device],
    target: ModelConfig,
    target_num_layers: int,
    capture_layers: Optional[Sequence[int]] = None,
) -> Eagle3Draft:
    """The EAGLE-3 draft in `model_dir` for `target`; `capture_layers` (eagle3_layers_to_capture) overrides the
    config's eagle_aux_hidden_state_layer_ids."""
    with model_load_errors():
        files = read_eagle3_files(model_dir)
        folder, raw, state = files.folder, files.config, files.state
        config, draft_vocab_size = parse_eagle3_config(raw, str(folder / CONFIG_FILE))
        _check_target(folder, raw, config, target)
        if capture_layers is None:
            capture_layers = captured_layers(raw, folder)
        layers = resolve_capture_layers(capture_layers, target_num_layers, str(folder))
        draft = Eagle3Draft(config, draft_vocab_size, layers, len(layers) * target.hidden_size)
        copy_weights(draft.checkpoint_slots(), state, folder, "EAGLE-3", (D2T_KEY,) + EAGLE3_IGNORED)
        draft.draft_to_target = draft_to_target(state.get(D2T_KEY), draft_vocab_size, config.vocab_size, folder)
    draft = draft.to(device=device, dtype=dtype).eval()
    draft.rotary_emb.reset_frequencies(torch.device(device))  # fp32 frequencies whatever the dtype
    draft.pack_for_cpu()
    return draft


def _check_target(folder: Path, raw: dict[str, Any], config: ModelConfig, target: ModelConfig) -> None:
    """The draft embeds with the target's table, reads its hidden states and proposes its token ids."""
    sizes = (
        ("hidden_size", config.hidden_size, target.hidden_size),
        ("target_hidden_size", raw.get("target_hidden_size") or config.hidden_size, target.hidden_size),
        ("vocab_size", config.vocab_size, target.vocab_size),
    )
    for name, ours, theirs in sizes:
        if ours != theirs:
            raise ModelLoadError(f"{folder}: the draft's {name} is {ours}, the target's {theirs}")
