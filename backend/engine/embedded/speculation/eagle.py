"""EAGLE-1/2 draft layers: the layer, its config, and loading / saving it in the EAGLE checkpoint format (whose
files tritonllm.spec_decode.eagle_format reads and writes).

An EAGLE-1/2 draft is one Llama decoder layer without `input_layernorm`, preceded by `fc` ([H, 2H], with a bias
unless config.json says `"bias": false`). It has no embedding or LM head of its own: it borrows the target's. At
draft position j its input is `fc(cat(embed(token[j + 1]), feature[j]))`, where the feature is the target's
final-norm hidden state at position j (for committed positions) or the draft layer's own output at its parent
(for drafted ones); its output goes through the target's LM head as it is, without a norm (cut to the draft's
`draft_vocab` rows, our format extension, when it has one).

Loading failures are ModelLoadErrors naming the file, tensor or setting at fault."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from tritonllm.spec_decode.checkpoint_files import (
    CONFIG_FILE,
    DRAFT_VOCAB_KEY,
    CheckpointError,
    copy_weights,
    read_draft_vocab,
)
from tritonllm.spec_decode.eagle_format import (
    IGNORED,
    LAYER_PREFIX,
    TARGET_ONLY_KEYS,
    read_eagle_files,
    write_draft_folder,
)

from ..attention import AttentionMetadata
from ..network.layers import Linear, RotaryEmbedding
from ..network.llama import LlamaDecoderLayer, WeightSlot, layer_slots_without_input_norm
from ..network.model_config import ModelConfig, ModelLoadError
from .draft_head import DraftHead


@contextmanager
def model_load_errors() -> Iterator[None]:
    """The checkpoint format's CheckpointError as the engine's ModelLoadError, with the same message."""
    try:
        yield
    except CheckpointError as exc:
        raise ModelLoadError(str(exc)) from None


class EagleDraft(nn.Module):
    """fc + one decoder layer (no input norm). `forward` takes the token embeddings (the target's embedding of
    each draft position's token) and the features, and returns the layer's output, to go through the target's LM
    head unnormalised."""

    draft_vocab: Optional[torch.Tensor]  # a buffer (register_buffer)

    def __init__(self, config: ModelConfig, bias: bool = True):
        super().__init__()
        self.config = config
        self.bias = bias
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=bias)
        self.layer = LlamaDecoderLayer(config)
        # EAGLE's layer has no input norm: an identity stands in (its checkpoint slots leave the norm out).
        self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)
        # Target token ids the draft may propose (None: all); a buffer, so it moves with the draft.
        self.register_buffer("draft_vocab", None, persistent=False)

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
        """embeds, features: [T, hidden]; positions: [T]; kv_cache: the layer's (k, v) paged cache."""
        hidden = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        return self.layer(hidden, cos, sin, attn, kv_cache)

    def make_head(self, target) -> DraftHead:
        """The head drafts are scored with: the target's, cut to the draft vocabulary if there is one."""
        return DraftHead(target, self.draft_vocab)

    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        """Every tensor an EAGLE-1/2 checkpoint must hold, by its name there."""
        slots = {"fc.weight": WeightSlot(self.fc.weight, 0, tuple(self.fc.weight.shape))}
        if self.fc.bias is not None:
            slots["fc.bias"] = WeightSlot(self.fc.bias, 0, tuple(self.fc.bias.shape))
        # The shared Llama slot map, but for the input norm this layer does not have.
        slots.update(layer_slots_without_input_norm(LAYER_PREFIX, self.layer))
        return slots

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The weights under the EAGLE format's key names."""
        return {
            name: slot.param.detach().narrow(0, slot.start, slot.shape[0]).contiguous().clone()
            for name, slot in self.checkpoint_slots().items()
        }

    def pack_for_cpu(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()


# ---- config ---------------------------------------------------------------------------------------------------


def eagle_config_for(target_config: dict[str, Any], bias: bool = True) -> dict[str, Any]:
    """An EAGLE-1/2 config.json for a target's config.json: the target's sizes, one Llama layer (q/k/v biases
    kept for Qwen2 targets, as `qkv_bias`), `bias` for fc."""
    config = {key: value for key, value in target_config.items() if key not in TARGET_ONLY_KEYS}
    target = ModelConfig.from_dict(target_config, source="the target's config.json")
    if target.qk_norm:
        raise ModelLoadError("EAGLE-1/2 drafts have no q/k norms; a draft for a Qwen3 target is not supported")
    config.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        bias=bias,
        qkv_bias=target.qkv_bias,
        head_dim=target.head_dim,
        tie_word_embeddings=False,
    )
    return config


def parse_eagle_config(raw: dict[str, Any], source: str) -> tuple[ModelConfig, bool]:
    """(layer config, fc bias) from an EAGLE config.json. Its architecture is the layer's (Llama when unnamed)."""
    raw = dict(raw)
    if not raw.get("architectures") and not raw.get("model_type"):
        raw["architectures"] = ["LlamaForCausalLM"]
    config = ModelConfig.from_dict(raw, source=source)
    if "qkv_bias" in raw:  # the EAGLE repository's switch for Qwen2 drafts
        config.qkv_bias = bool(raw["qkv_bias"])
    if config.qk_norm:
        raise ModelLoadError(f"{source}: EAGLE-1/2 drafts have no q/k norms (model_type {config.model_type})")
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise ModelLoadError(f"{source}: num_hidden_layers is {layers}; an EAGLE-1/2 draft has one layer")
    return config, bool(raw.get("bias", True))  # the EAGLE repository's default is a biased fc


# ---- checkpoint folder ----------------------------------------------------------------------------------------


def save_eagle(
    draft: EagleDraft,
    out_dir: Union[str, Path],
    config: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    pickle: bool = False,
    draft_vocab: Optional[torch.Tensor] = None,
) -> Path:
    """Write `config.json` and the weights (`model.safetensors`, or `pytorch_model.bin` with `pickle`), with
    `draft_vocab` (token ids) if given."""
    state = {key: value.to(dtype) for key, value in draft.checkpoint_state().items()}
    if draft_vocab is not None:
        state[DRAFT_VOCAB_KEY] = draft_vocab.to(torch.long).contiguous()
        config = dict(config, draft_vocab_size=len(draft_vocab))
    return write_draft_folder(out_dir, state, dict(config, bias=draft.bias), dtype, pickle)


def random_eagle(
    target_dir: Union[str, Path], out_dir: Union[str, Path], seed: int = 0, bias: bool = True, scale: float = 1.0
) -> Path:
    """An untrained EAGLE-1/2 folder for the model in `target_dir` (random weights, for tests and as a start
    for training): weights ~ N(0, scale / fan_in), norms 1."""
    target_config = json.loads((Path(target_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    config = eagle_config_for(target_config, bias)
    layer_config, _ = parse_eagle_config(config, CONFIG_FILE)
    draft = EagleDraft(layer_config, bias)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("layernorm.weight"):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1 * scale)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * scale / math.sqrt(param.shape[1]))
    return save_eagle(draft, out_dir, config)


def load_eagle(
    model_dir: Union[str, Path],
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    target: Optional[ModelConfig] = None,
) -> EagleDraft:
    """The EAGLE-1/2 draft in `model_dir` (or `builtin:NAME`, a draft shipped here); with `target`, its hidden size
    and vocabulary must match the target's."""
    with model_load_errors():
        files = read_eagle_files(model_dir)
        folder, state = files.folder, files.state
        config, bias = parse_eagle_config(files.config, str(folder / CONFIG_FILE))
        vocab = read_draft_vocab(state, config.vocab_size, folder, "EAGLE")
        if target is not None:
            if config.hidden_size != target.hidden_size:
                raise ModelLoadError(
                    f"{folder}: the draft's hidden_size is {config.hidden_size}, the target's {target.hidden_size}"
                )
            if config.vocab_size != target.vocab_size:
                raise ModelLoadError(
                    f"{folder}: the draft's vocab_size is {config.vocab_size}, the target's {target.vocab_size}"
                )
        draft = EagleDraft(config, bias)
        copy_weights(
            draft.checkpoint_slots(),
            state,
            folder,
            "EAGLE",
            IGNORED,
            hints={
                "fc.bias": ' (config.json says bias is true, the default; set "bias": false for an fc without bias)'
            },
        )
    embed = state.get("embed_tokens.weight")
    if embed is not None and target is not None and tuple(embed.shape) != (target.vocab_size, target.hidden_size):
        raise ModelLoadError(
            f"{folder}: EAGLE tensor embed_tokens.weight has shape {list(embed.shape)}, the "
            f"target's embedding is {[target.vocab_size, target.hidden_size]}"
        )
    draft.draft_vocab = vocab
    draft = draft.to(device=device, dtype=dtype).eval()
    draft.rotary_emb.reset_frequencies(torch.device(device))  # fp32 frequencies whatever the dtype
    draft.pack_for_cpu()
    return draft
