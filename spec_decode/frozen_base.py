"""The frozen base model that Medusa heads and EAGLE drafts are trained against: loaded once in fp32, then run
over token windows for its final-norm hidden states and its own greedy choices."""
from __future__ import annotations

import torch
from tqdm import tqdm


def load_base(model_dir, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(device).startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # the targets are fp32 greedy choices, as the engine makes
        torch.backends.cudnn.allow_tf32 = False
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    base.requires_grad_(False)
    return tokenizer, base


@torch.no_grad()
def base_outputs(base, windows: list[torch.Tensor], progress: bool,
                 batch: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per window: final-norm hidden states [n, hidden] and the base model's greedy choices [n] (`batch`
    windows per forward, right-padded)."""
    device = next(base.parameters()).device
    hidden, choices = [], []
    for first in tqdm(range(0, len(windows), batch), desc="Base model forward", unit="batch",
                      disable=not progress):
        chunk = windows[first:first + batch]
        width = max(len(ids) for ids in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, window in enumerate(chunk):
            ids[row, :len(window)], mask[row, :len(window)] = window, 1
        states = base.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        best = base.get_output_embeddings()(states).argmax(dim=-1)
        for row, window in enumerate(chunk):
            hidden.append(states[row, :len(window)])
            choices.append(best[row, :len(window)])
    return hidden, choices
