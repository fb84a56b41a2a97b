"""Medusa heads in the Medusa checkpoint format, and the proposer that turns their top-k into a draft tree.

Head h is `ResBlock^L` (x + SiLU(Linear(x)), with bias) then a vocabulary projection without bias, applied to
the target's final-norm hidden state; head h guesses the token h+2 positions ahead (the target itself guesses the
next one, the tree's root). A checkpoint folder holds `config.json` (`medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) and `medusa_lm_head.safetensors` or `medusa_lm_head.pt` with keys
`{h}.{l}.linear.weight|bias` and `{h}.{L}.weight` (a `medusa_head.` prefix, as full Medusa-2 models use, is
stripped). The head and layer counts are read from the tensors, since published configs are not reliable."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tritonllm.engine.embedded.models.model_config import ModelLoadError

from .config import Choices
from .proposer import ProposalInput, StatelessProposer, draft_budget
from .tree import DraftTree, TreeTemplate, default_choices

log = logging.getLogger("tritonllm.spec_decode")

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "medusa_lm_head.safetensors"
PICKLE_FILE = "medusa_lm_head.pt"
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
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                          nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, heads, vocab]."""
        return torch.stack([head(hidden) for head in self.heads], dim=1)

    @torch.inference_mode()
    def top_k(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden: [N, hidden] -> token ids [N, heads, k], best first."""
        return self(hidden).topk(k, dim=-1).indices

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """State dict under the Medusa format's key names."""
        return {key.removeprefix("heads."): value.detach().contiguous() for key, value in self.state_dict().items()}

    def copy_lm_head(self, weight: torch.Tensor) -> None:
        """Every head's vocabulary projection starts as (a copy of) the base model's."""
        with torch.no_grad():
            for head in self.heads:
                head[-1].weight.copy_(weight)


# ---- checkpoint folder ----------------------------------------------------------------------------------------

def save_medusa(heads: MedusaHeads, out_dir: Union[str, Path], base_model: str = "",
                dtype: torch.dtype = torch.float32) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {key: value.to(dtype) for key, value in heads.checkpoint_state().items()}
    save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": base_model, "hidden_size": heads.hidden_size,
              "vocab_size": heads.vocab_size}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def load_medusa(model_dir: Union[str, Path], dtype: torch.dtype = torch.float32,
                device: Union[str, torch.device] = "cpu") -> MedusaHeads:
    folder = Path(model_dir)
    config = _read_config(folder)
    state = _strip_prefix(_read_weights(folder))
    num_heads, num_layers = _shape_from_keys(state, folder)
    if config.get("medusa_num_heads") not in (None, num_heads):
        log.warning("%s: config.json says %s heads but the weights hold %d; using %d", folder,
                    config["medusa_num_heads"], num_heads, num_heads)
    vocab_size, hidden_size = state[f"0.{num_layers}.weight"].shape
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers)
    expected = heads.checkpoint_state()
    for key, tensor in expected.items():
        if key not in state:
            raise ModelLoadError(f"{folder}: Medusa weights lack {key}")
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{folder}: Medusa tensor {key} has shape {list(state[key].shape)}, "
                                 f"expected {list(tensor.shape)}")
    heads.load_state_dict({f"heads.{key}": state[key] for key in expected})
    return heads.to(device=device, dtype=dtype).eval()


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no {CONFIG_FILE} (a Medusa checkpoint folder has config.json and "
                             f"{SAFETENSORS_FILE} or {PICKLE_FILE})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / SAFETENSORS_FILE).is_file():
        try:
            return load_file(str(folder / SAFETENSORS_FILE))
        except Exception as err:  # safetensors raises its own error types
            raise ModelLoadError(f"{folder / SAFETENSORS_FILE}: not a readable safetensors file ({err})") from None
    if (folder / PICKLE_FILE).is_file():
        try:  # weights_only: a checkpoint must never run code on load
            return torch.load(folder / PICKLE_FILE, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ModelLoadError(f"{folder / PICKLE_FILE}: cannot read Medusa weights ({err})") from None
    raise ModelLoadError(f"{folder}: no {SAFETENSORS_FILE} or {PICKLE_FILE}")


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "medusa_head."
    if any(key.startswith(prefix) for key in state):
        return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    return state


def _shape_from_keys(state: dict[str, torch.Tensor], folder: Path) -> tuple[int, int]:
    """(heads, layers) from key names; the vocabulary projection is the one `{h}.{L}.weight` without 'linear'."""
    heads, projection_index = set(), set()
    for key in state:
        match = _KEY.match(key)
        if match is None:
            raise ModelLoadError(f"{folder}: unexpected tensor {key} in Medusa weights")
        heads.add(int(match.group(1)))
        if match.group(3) == "weight":
            projection_index.add(int(match.group(2)))
    if not heads or len(projection_index) != 1:
        raise ModelLoadError(f"{folder}: Medusa weights need one '{{head}}.{{layers}}.weight' per head")
    num_heads = max(heads) + 1
    if sorted(heads) != list(range(num_heads)):
        raise ModelLoadError(f"{folder}: Medusa heads are not numbered 0..{num_heads - 1}")
    return num_heads, projection_index.pop()


# ---- proposer -------------------------------------------------------------------------------------------------

class MedusaProposer(StatelessProposer):
    """Fills the `medusa_choices` tree (or a default one) from each head's top-k on the target's hidden state."""

    def __init__(self, heads: MedusaHeads, choices: Optional[Choices] = None, max_draft_tokens: int = 0):
        choices = choices or default_choices(heads.num_heads, num_nodes=4 * heads.num_heads)
        self.template = TreeTemplate.from_choices(choices)
        if self.template.depth > heads.num_heads:
            raise ModelLoadError(f"medusa_choices is {self.template.depth} deep but the checkpoint has "
                                 f"{heads.num_heads} heads")
        self.heads = heads
        self.max_draft_tokens = max_draft_tokens or len(self.template.paths)

    def propose(self, batch: Sequence[ProposalInput]) -> list[DraftTree]:
        missing = [item.seq_id for item in batch if item.hidden_state is None]
        if missing:
            raise ValueError(f"Medusa needs the target's hidden state; sequences {missing} have none")
        if not batch:
            return []
        weight = next(self.heads.parameters())
        hidden = torch.stack([item.hidden_state for item in batch]).to(weight.device, weight.dtype)
        candidates = self.heads.top_k(hidden, self.template.max_rank).tolist()  # one batched head pass
        return [self.template.fill(per_head).truncated(draft_budget(self.max_draft_tokens, item))
                for per_head, item in zip(candidates, batch)]
