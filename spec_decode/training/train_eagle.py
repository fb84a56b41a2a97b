"""Trains an EAGLE-1/2 draft layer for a Hugging Face model (the base frozen) on the model's own answers, and saves
it in the EAGLE checkpoint format (eagle.py).

Data: the same self-distillation as Medusa's `--distill-prompts` (distill.py): the base model's answers to chat
requests about the shipped texts and topics, some topics kept apart for validation; accuracy is reported on its
answers to the requests `tritonllm bench spec` makes, which are never trained on.

Model: `EagleDraft`, the engine's own module, run densely here (causal attention over whole sequences) instead of
over the paged cache. At row j the draft sees (token j+1, feature j), the feature being the target's final-norm
hidden state, and must output feature j+1: smooth-L1 on the feature plus `token_weight` times the cross-entropy
of the target's LM head on it against the target's distribution at j+1 (EAGLE-1's objective).

Training-time test (`passes` > 1): pass k gives row j its own pass k-1 output as the feature, at position j+k-1,
with token j+k; it attends to pass 1's keys up to row j and to its earlier passes' keys of row j alone. That is
what drafting k deep sees in the engine (the stable KV built from the target's features, then the draft's own
nodes), so the deeper drafts learn from the features they will really get. Tokens stay the true ones: a deeper
draft only counts once the shallower ones were right.

The draft starts from small random weights behind an fc that passes the feature through (a copy of the target's
last layer was tried: its activations are far larger than a final-norm feature and the loss started huge).

Draft vocabulary (`draft_vocab` > 0, our extension of the format, see eagle.py): the most frequent greedy choices
of the training answers are saved with the draft, and the engine drafts from those tokens alone, so each draft
step's LM head costs a fraction of the full vocabulary's."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar, Union

import torch
import torch.nn.functional as F

from tritonllm.engine.embedded.network.layers import apply_rotary
from tritonllm.engine.embedded.network.llama import DecoderLayerParts
from tritonllm.engine.embedded.speculation.eagle import EagleDraft, eagle_config_for, parse_eagle_config, save_eagle

from ..checkpoint_files import frequent_tokens
from . import distill
from .frozen_base import base_outputs, load_base
from .train_medusa import default_text
from .training_loop import BestCheckpoint, chain_score, deadline, run_steps

if TYPE_CHECKING:
    from tritonllm.engine.embedded.speculation.eagle3 import Eagle3Draft

Draft = TypeVar("Draft", bound="EagleDraft | Eagle3Draft")


@dataclass
class EagleTrainSettings:
    steps: int = 200
    batch_sequences: int = 8
    learning_rate: float = 5e-4
    passes: int = 3  # training-time test depth
    token_weight: float = 0.1
    feature_noise: float = 0.05  # uniform noise on pass 1's input features, times their standard deviation
    draft_vocab: int = 0  # > 0: save the most frequent greedy choices as the draft vocabulary
    distill_prompts: int = 64
    distill_max_tokens: int = 256
    distill_batch: int = 16
    distill_rounds: int = 1
    distill_temperature: float = 0.7
    distill_own_requests: int = 0  # > 0: also this many requests the model writes itself (distill.py)
    validation_share: float = 0.05
    forward_batch: int = 8
    eval_every: int = 100
    seed: int = 0
    device: str = "cpu"
    save_dtype: torch.dtype = torch.float32
    progress: bool = True
    time_limit: float = 0.0  # > 0: stop the steps this many seconds after the start (training_loop.run_steps)


@dataclass
class EagleTrainReport:
    out_dir: Path
    num_tokens: int
    first_loss: float
    last_loss: float
    accuracy: list[float]  # per depth, top-1 agreement with the target's greedy choice, on the bench's requests
    validation_accuracy: Optional[list[float]]
    best_step: Optional[int]
    draft_vocab: int
    seconds: float
    capture_layers: Optional[list[int]] = None  # EAGLE-3: the target layers whose outputs the draft reads


@dataclass
class Target:
    """The frozen target's token embedding and LM head, which the draft borrows."""

    embed: torch.Tensor  # [vocab, H]
    lm_head: torch.Tensor  # [vocab, H]

    @classmethod
    def of(cls, base) -> "Target":
        return cls(base.get_input_embeddings().weight.detach(), base.get_output_embeddings().weight.detach())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.t()


@dataclass
class _Data:
    """Sequences padded to one width: ids, the target's features and greedy choices, and the first row of each
    whose loss counts."""

    ids: torch.Tensor  # [S, N] (0-padded)
    features: torch.Tensor  # [S, N, H] (EAGLE-3: [S, N, layers * H], the captured layers' outputs)
    choices: torch.Tensor  # [S, N]: the target's greedy token after each row (fp32, as the engine decodes)
    lengths: torch.Tensor  # [S]
    first_rows: torch.Tensor  # [S]: rows before it are prompt rows no draft starts from

    def batch(self, rows: torch.Tensor) -> _Data:
        width = int(self.lengths[rows].max())
        return _Data(
            self.ids[rows, :width],
            self.features[rows, :width],
            self.choices[rows, :width],
            self.lengths[rows],
            self.first_rows[rows],
        )


def train_eagle(
    model_dir: Union[str, Path], out_dir: Union[str, Path], settings: EagleTrainSettings, text: Optional[str] = None
) -> EagleTrainReport:
    started = time.monotonic()
    base, (train, validation, held) = base_and_data(model_dir, settings, text)
    config = eagle_config_for(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))
    draft = _initial_draft(config).to(settings.device)
    target = Target.of(base)
    vocab = frequent_choices(train, target, settings.draft_vocab) if settings.draft_vocab else None
    fitted = fit(
        draft,
        (train, validation, held),
        settings,
        started,
        lambda batch, noise_scale: _loss(draft, target, batch, settings, noise_scale),
        lambda data: depth_accuracy(draft, target, data, settings.passes),
    )
    save_eagle(draft.cpu(), out_dir, config, dtype=settings.save_dtype, draft_vocab=vocab)
    return fitted.report(out_dir, train, 0 if vocab is None else len(vocab), started)


def base_and_data(
    model_dir: Union[str, Path],
    settings: EagleTrainSettings,
    text: Optional[str],
    capture_layers: Optional[Sequence[int]] = None,
):
    """The frozen base and its (train, validation or None, held-out) data, the seed set first."""
    torch.manual_seed(settings.seed)
    tokenizer, base = load_base(model_dir, settings.device)
    return base, _chat_data(base, tokenizer, settings, text, capture_layers)


@dataclass
class Fitted:
    """What training measured: the losses, the kept step, and per-depth accuracy on held-out and validation data."""

    losses: list[float]
    best_step: Optional[int]
    accuracy: list[float]
    validation_accuracy: Optional[list[float]]

    def report(self, out_dir: Union[str, Path], train: _Data, draft_vocab: int, started: float) -> EagleTrainReport:
        return EagleTrainReport(
            Path(out_dir),
            int(train.lengths.sum()),
            self.losses[0],
            self.losses[-1],
            self.accuracy,
            self.validation_accuracy,
            self.best_step,
            draft_vocab,
            time.monotonic() - started,
        )


def fit(
    draft: torch.nn.Module,
    data: tuple[_Data, Optional[_Data], _Data],
    settings: EagleTrainSettings,
    started: float,
    loss: Callable[[_Data, float], torch.Tensor],
    accuracy: Callable[[_Data], list[float]],
) -> Fitted:
    """`train_draft` on (train, validation, held-out) data, then the kept weights' accuracy."""
    train, validation, held = data
    with _tf32(settings.device):  # the draft's own maths; the targets were computed in full fp32
        losses, best_step = train_draft(
            draft, train, validation, settings, deadline(started, settings.time_limit), loss, accuracy
        )
    return Fitted(losses, best_step, accuracy(held), accuracy(validation) if validation else None)


@contextmanager
def _tf32(device: str):
    """TF32 matmuls on CUDA while the block runs (several times faster for the LM-head products of training)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = str(device).startswith("cuda")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _chat_data(
    base, tokenizer, settings: EagleTrainSettings, text: Optional[str], capture_layers: Optional[Sequence[int]] = None
):
    """(train, validation or None, held-out) data; the features are the final-norm hidden states, or with
    `capture_layers` (EAGLE-3) those layers' outputs side by side."""
    train, validation, held = distill.distilled_sets(
        base, tokenizer, text if text is not None else default_text(), settings
    )
    return (
        _padded(base, train, settings, settings.progress, capture_layers),
        _padded(base, validation, settings, False, capture_layers) if validation else None,
        _padded(base, held, settings, False, capture_layers),
    )


def _padded(
    base,
    sequences: list[distill.Distilled],
    settings: EagleTrainSettings,
    progress: bool,
    capture_layers: Optional[Sequence[int]],
) -> _Data:
    """Every sequence's ids and target features, padded to the longest (all held on the training device: ~2.3 KB
    per token for SmolLM2, so GPU-sized for large runs; EAGLE-3's three captured layers triple that)."""
    features, choices = base_outputs(
        base, [torch.tensor(ids) for ids, _ in sequences], progress, settings.forward_batch, capture_layers
    )
    width = max(len(tokens) for tokens, _ in sequences)
    device = features[0].device
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    padded = torch.zeros(len(sequences), width, features[0].shape[-1], device=device)
    greedy = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    for row, ((tokens, _), states, chosen) in enumerate(zip(sequences, features, choices)):
        ids[row, : len(tokens)] = torch.tensor(tokens, device=device)
        padded[row, : len(tokens)] = states
        greedy[row, : len(tokens)] = chosen
    lengths = torch.tensor([len(tokens) for tokens, _ in sequences], device=device)
    # A draft starts at a root r >= the prompt's last token; its pass-1 row is r - 1.
    first_rows = torch.tensor([max(0, start - 2) for _, start in sequences], device=device)
    return _Data(ids, padded, greedy, lengths, first_rows)


def _initial_draft(config: dict) -> EagleDraft:
    """Small random projections behind an fc that passes the feature on: the draft starts out repeating the
    target's guess at its row (its output is about its input feature) and learns to look one token further."""
    layer_config, bias = parse_eagle_config(config, "config.json")
    hidden = layer_config.hidden_size
    draft = small_random(EagleDraft(layer_config, bias), hidden)
    with torch.no_grad():
        draft.fc.weight[:, hidden:] += torch.eye(hidden)
    return draft


def small_random(draft: Draft, hidden: int) -> Draft:
    """Norms 1, biases 0, matrices ~ N(0, 0.02^2 * hidden / fan_in); fp32 rotary frequencies."""
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                param.normal_(0.0, 0.02 / math.sqrt(param.shape[1] / hidden))
    draft.rotary_emb.reset_frequencies(torch.device("cpu"))
    return draft


# ---- the draft, densely, pass by pass -------------------------------------------------------------------------

# (residual, attention input) of a pass from its token embeddings [B, N, H] and its input features
LayerInput = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def dense_passes(
    draft: EagleDraft, embed: torch.Tensor, ids: torch.Tensor, features: torch.Tensor, passes: int
) -> list[torch.Tensor]:
    """The draft's outputs [B, N, H] for passes 1..`passes` (see the module docstring); rows whose token
    j + k lies past the width get token 0 (their losses are masked)."""

    def layer_input(embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = draft.fc(torch.cat((embeds, feature), dim=-1))  # no input norm: x is both
        return x, x

    return layer_passes(draft.layer, draft.rotary_emb, embed, ids, features, passes, layer_input)


def layer_passes(
    layer: DecoderLayerParts,
    rotary_emb,
    embed: torch.Tensor,
    ids: torch.Tensor,
    features: torch.Tensor,
    passes: int,
    layer_input: LayerInput,
) -> list[torch.Tensor]:
    """A draft decoder layer's outputs [B, N, H], pass by pass: pass k gives row j token j + k and the previous
    pass's output (pass 1: `features`), at position j + k - 1; `layer_input` is what comes before the attention."""
    batch, width = ids.shape
    attn = layer.self_attn
    keys, values, outputs = [], [], []
    feature = features
    for k in range(1, passes + 1):
        tokens = F.pad(ids[:, k:], (0, k))[:, :width]
        residual, x = layer_input(F.embedding(tokens, embed), feature)
        positions = torch.arange(width, device=ids.device) + (k - 1)
        cos, sin = rotary_emb(positions, x.dtype)
        qkv = attn.qkv_proj(x)
        q, key, value = qkv.split(attn.split_sizes, dim=-1)
        q = apply_rotary(q.view(batch, width, attn.num_heads, attn.head_dim), cos, sin)
        keys.append(apply_rotary(key.view(batch, width, attn.num_kv_heads, attn.head_dim), cos, sin))
        values.append(value.view(batch, width, attn.num_kv_heads, attn.head_dim))
        mask = _pass_mask(width, k, x.device, x.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            torch.cat(keys, 1).transpose(1, 2),
            torch.cat(values, 1).transpose(1, 2),
            attn_mask=mask,
            scale=attn.scale,
            enable_gqa=True,
        )
        hidden = residual + attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        outputs.append(hidden)
        feature = hidden
    return outputs


def _pass_mask(width: int, k: int, device, dtype) -> torch.Tensor:
    """[N, k*N] additive: pass 1's keys causally, each later pass's key of the same row only."""
    rows = torch.arange(width, device=device)
    visible = [rows[None, :] <= rows[:, None]] + [rows[None, :] == rows[:, None]] * (k - 1)
    allowed = torch.cat(visible, dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _valid(data: _Data, k: int) -> torch.Tensor:
    """[B, N]: rows whose pass-k target (row j + k) exists and where a draft may start."""
    rows = torch.arange(data.ids.shape[1], device=data.ids.device)[None, :]
    return (rows + k < data.lengths[:, None]) & (rows >= data.first_rows[:, None])


def _shifted(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """tensor[:, j + k] at row j, zero-padded past the end."""
    pad = (0, 0, 0, k) if tensor.dim() == 3 else (0, k)
    return F.pad(tensor[:, k:], pad)


def noisy_features(data: _Data, settings: EagleTrainSettings, noise_scale: float) -> torch.Tensor:
    """Pass 1's input features with uniform noise of `feature_noise` times their standard deviation."""
    features = data.features
    if settings.feature_noise:
        features = features + (torch.rand_like(features) * 2 - 1) * settings.feature_noise * noise_scale
    return features


# A pass's loss from its outputs at the rows that count [M, H], its depth k and those rows' mask [B, N]
PassLoss = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


def depth_weighted_loss(outputs: list[torch.Tensor], data: _Data, pass_loss: PassLoss) -> torch.Tensor:
    """Sum over passes k of 0.8^(k-1) times the pass's loss on its valid rows (`_valid`)."""
    total = outputs[0].new_zeros(())
    for k, out in enumerate(outputs, 1):
        valid = _valid(data, k)
        if valid.any():
            total = total + 0.8 ** (k - 1) * pass_loss(out[valid], k, valid)
    return total


def _loss(
    draft: EagleDraft, target: Target, data: _Data, settings: EagleTrainSettings, noise_scale: float
) -> torch.Tensor:
    def pass_loss(predicted: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
        wanted = _shifted(data.features, k)[valid]
        with torch.no_grad():
            wanted_probs = torch.softmax(target.logits(wanted), dim=-1)
        token_loss = -(wanted_probs * torch.log_softmax(target.logits(predicted), dim=-1)).sum(-1).mean()
        return F.smooth_l1_loss(predicted, wanted) + settings.token_weight * token_loss

    features = noisy_features(data, settings, noise_scale)
    return depth_weighted_loss(dense_passes(draft, target.embed, data.ids, features, settings.passes), data, pass_loss)


def train_draft(
    draft: torch.nn.Module,
    data: _Data,
    validation: Optional[_Data],
    settings: EagleTrainSettings,
    stop_at: Optional[float],
    loss: Callable[[_Data, float], torch.Tensor],
    accuracy: Callable[[_Data], list[float]],
) -> tuple[list[float], Optional[int]]:
    """AdamW steps on `loss(batch, noise_scale)` over random batches of `data` (warm-up, cosine decay), keeping the
    weights whose `accuracy` on `validation` chains best; returns the losses and that step."""
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    warmup = max(1, settings.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, settings.steps))))
        ),
    )
    generator = torch.Generator().manual_seed(settings.seed)
    noise_scale = float(data.features[data.features.abs().sum(-1) > 0].std())

    def batch_loss() -> torch.Tensor:
        rows = torch.randint(len(data.ids), (min(settings.batch_sequences, len(data.ids)),), generator=generator)
        return loss(data.batch(rows.to(data.ids.device)), noise_scale)

    best = BestCheckpoint(draft, None if validation is None else lambda: chain_score(accuracy(validation)))
    return run_steps(
        batch_loss,
        optimizer,
        schedule,
        settings.steps,
        settings.eval_every,
        best,
        "Training the EAGLE draft",
        settings.progress,
        clip=(list(draft.parameters()), 1.0),
        stop_at=stop_at,
    )


def depth_accuracy(draft: EagleDraft, target: Target, data: _Data, passes: int) -> list[float]:
    """Per depth k, how often the draft's top-1 at pass k is the target's greedy choice (true tokens before)."""
    return guess_accuracy(
        data,
        passes,
        lambda chunk: dense_passes(draft, target.embed, chunk.ids, chunk.features, passes),
        lambda hidden: target.logits(hidden).argmax(-1),
    )


@torch.no_grad()
def guess_accuracy(
    data: _Data,
    passes: int,
    run: Callable[[_Data], list[torch.Tensor]],
    guess: Callable[[torch.Tensor], torch.Tensor],
    batch: int = 16,
) -> list[float]:
    """Per depth k, how often `guess` (target ids from pass outputs [M, H]) on `run`'s pass k outputs for a chunk
    of `data` is the target's greedy choice."""
    hits, counts = [0] * passes, [0] * passes
    for first in range(0, len(data.ids), batch):
        chunk = data.batch(torch.arange(first, min(first + batch, len(data.ids)), device=data.ids.device))
        for k, out in enumerate(run(chunk), 1):
            valid = _valid(chunk, k)
            guessed = guess(out[valid])
            hits[k - 1] += int((guessed == _shifted(chunk.choices, k)[valid]).sum())
            counts[k - 1] += int(valid.sum())
    return [hit / count if count else 0.0 for hit, count in zip(hits, counts)]


def frequent_choices(data: _Data, target: Target, size: int) -> torch.Tensor:
    """The `size` tokens the target chooses most often over the training rows (sorted ids)."""
    chosen = data.choices[_valid(data, 0)].cpu()
    return frequent_tokens(torch.bincount(chosen, minlength=target.lm_head.shape[0]), size)
