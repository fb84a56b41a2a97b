"""Trains an EAGLE-3 draft (eagle3.py) for a Hugging Face model on its own answers, with train_eagle.py's data,
training-time test passes, step loop and validation-picked checkpoint, and saves it in the EAGLE-3 format.

What differs from EAGLE-1/2: the features are the outputs of a few target layers (`capture_layers`, side by side,
fp32), which fc squeezes to the hidden size on pass 1 (later passes feed the layer its own output, as drafting
does); the draft has a head of its own over a draft vocabulary (the training answers' most frequent greedy choices,
or the whole vocabulary), started from the target's LM-head rows and final norm; and the loss is that head's
cross-entropy against the target's greedy choice alone (EAGLE-3 drops the feature regression), rows whose choice
lies outside the draft vocabulary left out.

The features come from transformers' `output_hidden_states`, whose last entry is the final norm's output: the
last layer's own output is not there, so it cannot be a capture layer here."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from tritonllm.engine.config import ConfigError
from tritonllm.engine.embedded.network.model_config import ModelConfig
from tritonllm.engine.embedded.speculation.eagle3 import (
    Eagle3Draft,
    default_capture_layers,
    eagle3_config_for,
    parse_eagle3_config,
    resolve_capture_layers,
    save_eagle3,
)

from .train_eagle import (
    EagleTrainReport,
    EagleTrainSettings,
    Target,
    _Data,
    _shifted,
    base_and_data,
    depth_weighted_loss,
    fit,
    frequent_choices,
    guess_accuracy,
    layer_passes,
    noisy_features,
    small_random,
)


@dataclass
class Eagle3TrainSettings(EagleTrainSettings):
    """train_eagle's settings (`token_weight` unused); `draft_vocab` 0 means the whole vocabulary."""

    capture_layers: Optional[tuple[int, ...]] = None  # target layers whose outputs are the features; None: default


def train_eagle3(
    model_dir: Union[str, Path], out_dir: Union[str, Path], settings: Eagle3TrainSettings, text: Optional[str] = None
) -> EagleTrainReport:
    started = time.monotonic()
    target_config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    layers = trainable_capture_layers(settings.capture_layers, target_config)
    base, (train, validation, held) = base_and_data(model_dir, settings, text, layers)
    target = Target.of(base)
    vocab = frequent_choices(train, target, settings.draft_vocab or len(target.lm_head))
    config = eagle3_config_for(target_config, len(vocab), layers)
    draft = initial_draft(config, layers, vocab, base).to(settings.device)
    to_draft = draft_ids(vocab, len(target.lm_head)).to(settings.device)
    fitted = fit(
        draft,
        (train, validation, held),
        settings,
        started,
        lambda batch, noise_scale: draft_loss(draft, target.embed, to_draft, batch, settings, noise_scale),
        lambda data: depth_accuracy(draft, target.embed, data, settings.passes),
    )
    save_eagle3(draft.cpu(), out_dir, config, dtype=settings.save_dtype)
    return dataclasses.replace(fitted.report(out_dir, train, len(vocab), started), capture_layers=list(layers))


def trainable_capture_layers(requested: Optional[Sequence[int]], target_config: dict) -> tuple[int, ...]:
    """The capture layers (`requested` or EAGLE-3's default), checked as the engine checks them, and each below the
    target's last layer (see the module docstring)."""
    num_layers = ModelConfig.from_dict(target_config, source="the target's config.json").num_layers
    where = (
        "--capture-layers"
        if requested is not None
        else f"the default capture layers for a target of {num_layers} layers (pass --capture-layers)"
    )
    layers = resolve_capture_layers(
        requested if requested is not None else default_capture_layers(num_layers), num_layers, where
    )
    if num_layers - 1 in layers:
        raise ConfigError(
            f"{where}: layer {num_layers - 1} is the target's last; transformers gives its output only "
            f"after the final norm, so training cannot capture it: pick layers below {num_layers - 1}"
        )
    return layers


def initial_draft(config: dict, layers: tuple[int, ...], vocab: torch.Tensor, base) -> Eagle3Draft:
    """Small random weights (train_eagle's), but the head starts as the target's: its LM-head rows of the draft
    vocabulary behind its final norm, so the draft's first guesses are already tokens the target would score."""
    layer_config, vocab_size = parse_eagle3_config(config, "config.json")
    hidden = layer_config.hidden_size
    draft = small_random(Eagle3Draft(layer_config, vocab_size, layers, len(layers) * hidden), hidden)
    with torch.no_grad():
        lm_head = base.get_output_embeddings().weight
        draft.lm_head.weight.copy_(lm_head[vocab.to(lm_head.device)].cpu())
        draft.norm.weight.copy_(base.model.norm.weight.cpu())
    draft.draft_to_target = vocab.clone()
    return draft


def draft_ids(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size]: each target id's row in the draft head, -1 for ids outside the draft vocabulary."""
    return torch.full((vocab_size,), -1, dtype=torch.long).index_copy_(0, vocab, torch.arange(len(vocab)))


def dense_passes(
    draft: Eagle3Draft, embed: torch.Tensor, ids: torch.Tensor, features: torch.Tensor, passes: int
) -> list[torch.Tensor]:
    """The draft's pre-norm outputs [B, N, H] for passes 1..`passes` (train_eagle's training-time test):
    pass 1 squeezes the target's features with fc, later passes take the previous pass's output as it is."""
    layer = draft.midlayer

    def layer_input(embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = draft.fc(feature) if feature.shape[-1] != draft.hidden_size else feature
        return hidden, torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)

    return layer_passes(layer, draft.rotary_emb, embed, ids, features, passes, layer_input)


def draft_loss(
    draft: Eagle3Draft,
    embed: torch.Tensor,
    to_draft: torch.Tensor,
    data: _Data,
    settings: Eagle3TrainSettings,
    noise_scale: float,
) -> torch.Tensor:
    head = draft.make_head(None)

    def pass_loss(hidden: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
        wanted = to_draft[_shifted(data.choices, k)[valid]]
        inside = wanted >= 0
        if not inside.any():
            return hidden.sum() * 0.0  # keeps the graph when no row of this pass counts
        return F.cross_entropy(head.logits(hidden[inside]), wanted[inside])

    features = noisy_features(data, settings, noise_scale)
    return depth_weighted_loss(dense_passes(draft, embed, data.ids, features, settings.passes), data, pass_loss)


def depth_accuracy(draft: Eagle3Draft, embed: torch.Tensor, data: _Data, passes: int) -> list[float]:
    """Per depth k, how often the draft head's top-1 (as a target id) is the target's greedy choice; choices
    outside the draft vocabulary count as misses."""
    head = draft.make_head(None)
    return guess_accuracy(
        data,
        passes,
        lambda chunk: dense_passes(draft, embed, chunk.ids, chunk.features, passes),
        lambda hidden: head.token_ids(head.logits(hidden).argmax(-1)),
    )
