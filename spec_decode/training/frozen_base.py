"""The frozen base model that Medusa heads and EAGLE drafts are trained against: loaded once in fp32, then run
over token windows for its final-norm hidden states (or, for EAGLE-3, some layers' outputs) and its own greedy
choices."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from tqdm import tqdm


def load_base(model_dir, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(device).startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # the targets are fp32 greedy choices, as the engine makes
        torch.backends.cudnn.allow_tf32 = False
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    # transformers decorates PreTrainedModel.to with functools.wraps(nn.Module.to), which mypy reads as unbound
    base = base.to(device).eval()  # type: ignore[arg-type]
    base.requires_grad_(False)
    return tokenizer, base


@torch.no_grad()
def base_outputs(
    base, windows: list[torch.Tensor], progress: bool, batch: int = 1, capture_layers: Optional[Sequence[int]] = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per window: final-norm hidden states [n, hidden] (with `capture_layers`: those layers' outputs side by side,
    [n, len(capture_layers) * hidden], ascending) and the base model's greedy choices [n] (`batch` windows per
    forward, right-padded)."""
    device = next(base.parameters()).device
    hidden, choices = [], []
    for first in tqdm(range(0, len(windows), batch), desc="Base model forward", unit="batch", disable=not progress):
        chunk = windows[first : first + batch]
        width = max(len(ids) for ids in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, window in enumerate(chunk):
            ids[row, : len(window)], mask[row, : len(window)] = window, 1
        out = base.model(
            input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=capture_layers is not None
        )
        best = base.get_output_embeddings()(out.last_hidden_state).argmax(dim=-1)
        states = out.last_hidden_state if capture_layers is None else captured(out.hidden_states, capture_layers)
        for row, window in enumerate(chunk):
            hidden.append(states[row, : len(window)])
            choices.append(best[row, : len(window)])
    return hidden, choices


def captured(hidden_states: tuple[torch.Tensor, ...], capture_layers: Sequence[int]) -> torch.Tensor:
    """The outputs of `capture_layers` from transformers' hidden_states (entry i + 1 is layer i's output, except the
    last entry, which is after the final norm: the last layer cannot be captured here)."""
    last = len(hidden_states) - 2
    if any(not 0 <= layer < last for layer in capture_layers):
        raise ValueError(
            f"capture layers {list(capture_layers)} must lie in [0, {last}): the last layer's output "
            f"is only seen through the final norm"
        )
    return torch.cat([hidden_states[layer + 1] for layer in sorted(capture_layers)], dim=-1)
