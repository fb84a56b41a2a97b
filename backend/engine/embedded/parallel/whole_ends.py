"""The target's embedding and output head, whole, for a drafter on rank 0 under tensor parallelism.

A tensor-parallel rank holds a vocabulary slice of each, behind collectives (an all-reduce of the lookups, a gather
of the logits) that rank 0 cannot call alone while it drafts. EAGLE's draft layer looks its tokens up in the target's
embedding and (EAGLE-1/2) scores them with the target's head, so rank 0 keeps whole copies of both for it: read from
the checkpoint (the embedding's when the head is tied to it), or random under `load_format: dummy`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..loader import DUMMY_STD, weight_files
from ..network.model_config import ModelConfig

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class WholeEnds:
    """What drafters read of the target (speculation/draft_head.py, eagle_proposer.py): `embed_tokens`,
    `output_weight` and `compute_logits`, over the whole vocabulary."""

    def __init__(self, embedding: torch.Tensor, head: torch.Tensor):
        self.embedding = embedding
        self.output_weight = head

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embedding)

    def compute_logits(self, hidden: torch.Tensor, cast: bool = True) -> torch.Tensor:
        logits = F.linear(hidden, self.output_weight)
        return logits.float() if cast else logits


def load_whole_ends(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, load_format: str
) -> WholeEnds:
    shape = (config.vocab_size, config.hidden_size)
    if load_format == "dummy":
        generator = torch.Generator(device=device).manual_seed(0)
        embedding = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, DUMMY_STD, generator=generator)
        head = embedding if config.tie_word_embeddings else torch.empty_like(embedding).normal_(0.0, DUMMY_STD)
        return WholeEnds(embedding, head)
    from safetensors import safe_open

    wanted = {EMBEDDING} if config.tie_word_embeddings else {EMBEDDING, HEAD}
    found: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in wanted & set(handle.keys()):
                found[name] = handle.get_tensor(name).to(dtype=dtype, device=device)
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"{model_dir}: no {', '.join(missing)} for the drafter's whole embedding and head")
    return WholeEnds(found[EMBEDDING], found.get(HEAD, found[EMBEDDING]))
