"""The small checkpoint folders speculative methods load (Medusa heads, EAGLE draft layers): a config.json and
one weights file, safetensors preferred over a pickled state dict. Every failure is a CheckpointError naming the
file and what was wrong with it (the engine reports it as a ModelLoadError, or as an InvalidRequestError naming
speculative_config.speculative_model_dir, with the same message)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file

from tritonllm.json_files import read_json_object

CONFIG_FILE = "config.json"
BUILTIN_PREFIX = "builtin:"
DRAFT_VOCAB_KEY = "draft_vocab"  # our extension: the token ids a draft may propose (eagle_format.py, medusa.py)


class CheckpointError(ValueError):
    """A Medusa or EAGLE checkpoint folder that cannot be read; the message names the file, tensor or key."""


def resolve_folder(model_dir: Union[str, Path], builtin: dict[str, str], kind: str) -> Path:
    """The folder a `speculative_model_dir` names: a path, or `builtin:NAME` for one shipped in this package
    (`builtin` maps NAME to its folder under spec_decode/data; `kind` ("Medusa heads") words the error)."""
    text = str(model_dir)
    if not text.startswith(BUILTIN_PREFIX):
        return Path(model_dir)
    name = text[len(BUILTIN_PREFIX) :]
    if name not in builtin:
        raise CheckpointError(
            f"no built-in {kind} named {name!r} (built in: {', '.join(BUILTIN_PREFIX + known for known in builtin)})"
        )
    return Path(str(resources.files("tritonllm.spec_decode").joinpath("data", builtin[name])))


def read_config(folder: Path, kind: str, weight_files: tuple[str, str]) -> dict[str, Any]:
    """`folder`/config.json as a dict; `kind` ("a Medusa") and `weight_files` word the error for a missing file."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: no {CONFIG_FILE} ({kind} checkpoint folder has {CONFIG_FILE} and "
            f"{weight_files[0]} or {weight_files[1]})"
        )
    return read_json_object(path, CONFIG_FILE, CheckpointError)


def read_weights(folder: Path, safetensors_file: str, pickle_file: str, kind: str) -> dict[str, torch.Tensor]:
    """The state dict of `folder`'s safetensors file, else of its pickle (loaded with weights_only)."""
    if (folder / safetensors_file).is_file():
        try:
            return load_file(str(folder / safetensors_file))
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{folder / safetensors_file}: not a readable safetensors file ({err})") from None
    if (folder / pickle_file).is_file():
        try:  # weights_only: a checkpoint must never run code on load
            state = torch.load(folder / pickle_file, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{folder / pickle_file}: cannot read {kind} weights ({err})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{folder / pickle_file}: does not hold a state dict")
        return state
    raise CheckpointError(f"{folder}: no {safetensors_file} or {pickle_file}")


def read_draft_vocab(
    state: dict[str, torch.Tensor], vocab_size: int, folder: Path, kind: str
) -> Optional[torch.Tensor]:
    """`state`'s draft vocabulary (removed from it), sorted; None without one. The ids must be distinct and, with
    `vocab_size` > 0, inside the vocabulary."""
    ids = state.pop(DRAFT_VOCAB_KEY, None)
    if ids is None:
        return None
    where = f"{folder}: {kind} tensor {DRAFT_VOCAB_KEY}"
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise CheckpointError(
            f"{where} must be a non-empty 1-D tensor of token ids, got shape {list(ids.shape)} of {ids.dtype}"
        )
    ids = ids.to(torch.long)
    if int(ids.min()) < 0 or (vocab_size > 0 and int(ids.max()) >= vocab_size):
        raise CheckpointError(f"{where} holds ids outside the vocabulary [0, {vocab_size})")
    if len(torch.unique(ids)) != len(ids):
        raise CheckpointError(f"{where} repeats token ids")
    return torch.sort(ids).values


def copy_weights(
    slots: dict[str, Any],
    state: dict[str, torch.Tensor],
    folder: Path,
    kind: str,
    ignored: tuple[str, ...] = (),
    hints: Optional[dict[str, str]] = None,
) -> None:
    """Copy `state` into `slots` (WeightSlot by checkpoint name): every slot's tensor must be there with its shape,
    and any other tensor must be `ignored` (or a rotary `inv_freq` buffer, which some exporters save); `hints` adds
    words to the error for a missing key, and `kind` ("EAGLE") words the errors."""
    for key in state:
        if key not in slots and key not in ignored and not key.endswith("rotary_emb.inv_freq"):
            raise CheckpointError(f"{folder}: unexpected tensor {key} in the {kind} weights")
    for key, slot in slots.items():
        if key not in state:
            raise CheckpointError(f"{folder}: {kind} weights lack {key}{(hints or {}).get(key, '')}")
        if tuple(state[key].shape) != slot.shape:
            raise CheckpointError(
                f"{folder}: {kind} tensor {key} has shape {list(state[key].shape)}, expected {list(slot.shape)}"
            )
        slot.copy_(state[key].float())


def frequent_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` ids with the highest `counts` ([vocab]; ties to the lower id), sorted: a draft vocabulary."""
    order = sorted(range(len(counts)), key=lambda token: (-int(counts[token]), token))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)
