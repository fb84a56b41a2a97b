"""Medusa heads in the Medusa checkpoint format, and the proposer that turns their top-k into a draft tree.

Head h is `ResBlock^L` (x + SiLU(Linear(x)), with bias) then a vocabulary projection without bias, applied to
the target's final-norm hidden state; head h guesses the token h+2 positions ahead (the target itself guesses the
next one, the tree's root). A checkpoint folder holds `config.json` (`medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) and `medusa_lm_head.safetensors` or `medusa_lm_head.pt` with keys
`{h}.{l}.linear.weight|bias` and `{h}.{L}.weight` (a `medusa_head.` prefix, as full Medusa-2 models use, is
stripped). The head and layer counts are read from the tensors, since published configs are not reliable.

Our extension to the format: `"medusa_shared_lm_head": true` in config.json means the heads have no vocabulary
projection of their own (no `{h}.{L}.weight` tensors) and use the base model's output head, which the user of the
heads supplies (`MedusaHeads.share_lm_head`: the weight or the target's `compute_logits`). All heads' logits then
come from one matmul over [N * heads, hidden], and the checkpoint is a few MB instead of one LM head per head.
Other Medusa implementations do not know the key; `tritonllm spec train-medusa --no-share-lm-head` writes the
standard format.

A second extension: a `draft_vocab` tensor (sorted, distinct token ids; `draft_vocab_size` in config.json) limits
the guesses to those tokens, so the heads' vocabulary products cover only their rows (`train-medusa --draft-vocab`;
the guesses are proposals, the target's output is the same either way).

`speculative_model_dir: builtin:NAME` names heads shipped in this package (spec_decode/data/NAME-medusa; see
BUILTIN_HEADS), e.g. `builtin:smollm2` for SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union, cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .checkpoint_files import (
    CONFIG_FILE,
    DRAFT_VOCAB_KEY,
    CheckpointError,
    read_config,
    read_draft_vocab,
    read_weights,
    resolve_folder,
)
from .config import Choices
from .proposer import ProposalInput, StatelessProposer, draft_budget
from .tree import DraftTree, TreeTemplate, default_choices

log = logging.getLogger("tritonllm.spec_decode")

SAFETENSORS_FILE = "medusa_lm_head.safetensors"
PICKLE_FILE = "medusa_lm_head.pt"
SHARED_KEY = "medusa_shared_lm_head"  # our config.json extension, see the module docstring
BUILTIN_HEADS = {"smollm2": "smollm2-medusa"}  # builtin:NAME -> folder under spec_decode/data
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        # Zero weights make a fresh head the identity, so it starts as a copy of the base LM head.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """`shared_lm_head`: the heads are ResBlocks only and use the base model's output head, given with
    `share_lm_head` before the first forward."""

    draft_vocab: Optional[torch.Tensor]  # a buffer (register_buffer)

    def __init__(
        self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1, shared_lm_head: bool = False
    ):
        super().__init__()
        if shared_lm_head and num_layers < 1:
            raise ValueError("Medusa heads sharing the base LM head need at least one ResBlock layer")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.shared_lm_head = shared_lm_head
        # Token ids the logits' columns stand for (None: all); a buffer, so it moves with the heads.
        self.register_buffer("draft_vocab", None, persistent=False)
        self._lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(num_layers)],
                *([] if shared_lm_head else [nn.Linear(hidden_size, vocab_size, bias=False)]),
            )
            for _ in range(num_heads)
        )

    def share_lm_head(
        self, lm_head: Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], vocab_size: int = 0
    ) -> None:
        """The base model's output head for shared heads: its weight [vocab, hidden], or a function mapping
        hidden states [M, hidden] to logits [M, vocab] (vocab_size then says the vocabulary size)."""
        if not self.shared_lm_head:
            raise ValueError("these Medusa heads have their own vocabulary projections")
        if isinstance(lm_head, torch.Tensor):
            if lm_head.dim() != 2 or lm_head.shape[1] != self.hidden_size:
                raise ValueError(
                    f"the LM head has shape {list(lm_head.shape)}; the Medusa heads need [vocab, {self.hidden_size}]"
                )
            weight, vocab_size = lm_head, lm_head.shape[0]
            lm_head = lambda states: F.linear(states, weight)  # noqa: E731
        self._lm_head = lm_head
        self.vocab_size = vocab_size or self.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, heads, vocab]."""
        out = torch.stack([head(hidden) for head in self.heads], dim=1)  # logits, or [N, heads, hidden] if shared
        if not self.shared_lm_head:
            return out
        if self._lm_head is None:
            raise RuntimeError("Medusa heads sharing the base LM head need it first (MedusaHeads.share_lm_head)")
        logits = self._lm_head(out.reshape(-1, self.hidden_size))  # every head in one matmul
        return logits.view(hidden.shape[0], self.num_heads, -1)

    @torch.inference_mode()
    def top_k(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden: [N, hidden] -> token ids [N, heads, k], best first."""
        return self.top_k_with_probabilities(hidden, k)[0]

    @torch.inference_mode()
    def top_k_with_probabilities(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, hidden] -> (token ids, their softmax probabilities under each head), each [N, heads, k]."""
        logits = self(hidden).float()
        values, indices = logits.topk(k, dim=-1)
        probabilities = torch.exp(values - torch.logsumexp(logits, dim=-1, keepdim=True))
        return (indices if self.draft_vocab is None else self.draft_vocab[indices]), probabilities

    def restrict_vocab(self, vocab: torch.Tensor) -> None:
        """Guess only tokens of `vocab` (sorted ids): own projections keep just those rows; heads sharing the base
        LM head need a `share_lm_head` function giving logits over `vocab` alone."""
        if not self.shared_lm_head:
            with torch.no_grad():
                for projection in self.projections():
                    rows = vocab.to(projection.weight.device)
                    projection.weight = nn.Parameter(projection.weight.index_select(0, rows))
        self.draft_vocab = vocab

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """State dict under the Medusa format's key names."""
        return {key.removeprefix("heads."): value.detach().contiguous() for key, value in self.state_dict().items()}

    def copy_lm_head(self, weight: torch.Tensor) -> None:
        """Every head's vocabulary projection starts as (a copy of) the base model's."""
        if self.shared_lm_head:
            raise ValueError("these Medusa heads share the base LM head; use share_lm_head")
        with torch.no_grad():
            for projection in self.projections():
                projection.weight.copy_(weight)

    def projections(self) -> list[nn.Linear]:
        """Each head's own vocabulary projection (none when the heads share the base LM head)."""
        heads = cast(Iterable[nn.Sequential], self.heads)  # a ModuleList hands out plain Modules
        return [] if self.shared_lm_head else [cast(nn.Linear, head[-1]) for head in heads]


# ---- checkpoint folder ----------------------------------------------------------------------------------------


def save_medusa(
    heads: MedusaHeads,
    out_dir: Union[str, Path],
    base_model: str = "",
    dtype: torch.dtype = torch.float32,
    draft_vocab: Optional[torch.Tensor] = None,
) -> Path:
    """Full-vocabulary heads, with `draft_vocab` (token ids) saved beside them if given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {key: value.to(dtype) for key, value in heads.checkpoint_state().items()}
    if draft_vocab is not None:
        state[DRAFT_VOCAB_KEY] = draft_vocab.to(torch.long).contiguous()
    save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": heads.num_layers,
        "base_model_name_or_path": base_model,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
    }
    if heads.shared_lm_head:
        config[SHARED_KEY] = True
    if draft_vocab is not None:
        config["draft_vocab_size"] = len(draft_vocab)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def resolve_heads_dir(model_dir: Union[str, Path]) -> Path:
    """The folder for a `speculative_model_dir` value: a path, or `builtin:NAME` for heads shipped here."""
    return resolve_folder(model_dir, BUILTIN_HEADS, "Medusa heads")


def load_medusa(
    model_dir: Union[str, Path], dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"
) -> MedusaHeads:
    """Heads from a checkpoint folder (or `builtin:NAME`). Shared-LM-head heads still need `share_lm_head`."""
    folder = resolve_heads_dir(model_dir)
    config = read_config(folder, "a Medusa", (SAFETENSORS_FILE, PICKLE_FILE))
    shared = config.get(SHARED_KEY, False)
    if not isinstance(shared, bool):
        raise CheckpointError(f"{folder / CONFIG_FILE}: {SHARED_KEY} must be true or false, got {shared!r}")
    state = read_weights(folder, SAFETENSORS_FILE, PICKLE_FILE, "Medusa")
    vocab = read_draft_vocab(state, 0, folder, "Medusa")  # ids checked against the vocabulary below
    state = _strip_prefix(state)
    num_heads, num_layers = _shape_from_keys(state, folder, shared)
    if config.get("medusa_num_heads") not in (None, num_heads):
        log.warning(
            "%s: config.json says %s heads but the weights hold %d; using %d",
            folder,
            config["medusa_num_heads"],
            num_heads,
            num_heads,
        )
    if shared:  # the vocabulary comes with the base model's head; config.json may record it
        hidden_size, vocab_size = state["0.0.linear.weight"].shape[1], int(config.get("vocab_size") or 0)
    else:
        vocab_size, hidden_size = state[f"0.{num_layers}.weight"].shape
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, shared_lm_head=shared)
    expected = heads.checkpoint_state()
    for key, tensor in expected.items():
        if key not in state:
            raise CheckpointError(f"{folder}: Medusa weights lack {key}")
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{folder}: Medusa tensor {key} has shape {list(state[key].shape)}, expected {list(tensor.shape)}"
            )
    heads.load_state_dict({f"heads.{key}": state[key] for key in expected})
    if vocab is not None:
        if vocab_size and int(vocab.max()) >= vocab_size:
            raise CheckpointError(
                f"{folder}: Medusa tensor {DRAFT_VOCAB_KEY} holds ids outside the vocabulary [0, {vocab_size})"
            )
        heads.restrict_vocab(vocab)
    return heads.to(device=device, dtype=dtype).eval()


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "medusa_head."
    if any(key.startswith(prefix) for key in state):
        return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    return state


def _shape_from_keys(state: dict[str, torch.Tensor], folder: Path, shared: bool = False) -> tuple[int, int]:
    """(heads, layers) from key names; the vocabulary projection is the one `{h}.{L}.weight` without 'linear'
    (absent when the heads share the base LM head: L is then one past the last ResBlock)."""
    heads: set[int] = set()
    projection_index: set[int] = set()
    block_index: set[int] = set()
    for key in state:
        match = _KEY.match(key)
        if match is None:
            raise CheckpointError(f"{folder}: unexpected tensor {key} in Medusa weights")
        heads.add(int(match.group(1)))
        (projection_index if match.group(3) == "weight" else block_index).add(int(match.group(2)))
    if shared:
        if projection_index:
            raise CheckpointError(
                f"{folder}: config.json says {SHARED_KEY} but the weights hold vocabulary "
                f"projections ('{{head}}.{min(projection_index)}.weight')"
            )
        if not block_index:
            raise CheckpointError(
                f"{folder}: Medusa heads sharing the base LM head need ResBlock weights "
                f"('{{head}}.{{layer}}.linear.weight|bias')"
            )
    elif not heads or len(projection_index) != 1:
        raise CheckpointError(
            f"{folder}: Medusa weights need one '{{head}}.{{layers}}.weight' per head (or "
            f'"{SHARED_KEY}": true in config.json for heads that use the base LM head)'
        )
    num_heads = max(heads) + 1
    if sorted(heads) != list(range(num_heads)):
        raise CheckpointError(f"{folder}: Medusa heads are not numbered 0..{num_heads - 1}")
    return num_heads, (max(block_index) + 1 if shared else projection_index.pop())


# ---- proposer -------------------------------------------------------------------------------------------------


class MedusaProposer(StatelessProposer):
    """Fills the `medusa_choices` tree (or a default one) from each head's top-k on the target's hidden state."""

    def __init__(
        self,
        heads: MedusaHeads,
        choices: Optional[Choices] = None,
        max_draft_tokens: int = 0,
        min_path_probability: float = 0.0,
    ):
        choices = choices or default_choices(heads.num_heads, num_nodes=4 * heads.num_heads)
        self.template = TreeTemplate.from_choices(choices)
        if self.template.depth > heads.num_heads:
            raise CheckpointError(
                f"medusa_choices is {self.template.depth} deep but the checkpoint has {heads.num_heads} heads"
            )
        self.heads = heads
        self.max_draft_tokens = max_draft_tokens or len(self.template.paths)
        self.min_path_probability = min_path_probability

    def propose(self, batch: Sequence[ProposalInput]) -> list[DraftTree]:
        missing = [item.seq_id for item in batch if item.hidden_state is None]
        if missing:
            raise ValueError(f"Medusa needs the target's hidden state; sequences {missing} have none")
        if not batch:
            return []
        weight = next(self.heads.parameters())
        states = [item.hidden_state for item in batch if item.hidden_state is not None]  # all of them: checked
        hidden = torch.stack(states).to(weight.device, weight.dtype)
        candidates, probabilities = self.heads.top_k_with_probabilities(hidden, self.template.max_rank)  # one pass
        return [
            self.template.fill(per_head, chances, self.min_path_probability).truncated(
                draft_budget(self.max_draft_tokens, item)
            )
            for per_head, chances, item in zip(candidates.tolist(), probabilities.tolist(), batch)
        ]
