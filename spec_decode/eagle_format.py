"""EAGLE draft checkpoints as files: the folder layouts of EAGLE-1/2 and EAGLE-3 drafts, reading and writing them.
No model code: the layers these weights fill are built by tritonllm.engine.embedded.speculation.eagle (EAGLE-1/2)
and .eagle3, which call these functions.

EAGLE-1/2: a folder holds `config.json` (Hugging Face Llama style, `num_hidden_layers: 1`, optional `bias` and
`qkv_bias`) and `model.safetensors` or `pytorch_model.bin` with the keys the EAGLE repository writes: `fc.weight`,
`fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight` (q/k/v biases with `qkv_bias`),
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, and optionally
`embed_tokens.weight`, which is ignored (the target's embedding is used). EAGLE-3 drafts (`midlayer.*`, `d2t`) are
a different format (`decoding_type: Eagle3`); given as EAGLE-1/2 they are refused with a message saying so.

Our extension to the EAGLE-1/2 format: a `draft_vocab` tensor (sorted, distinct target token ids;
`draft_vocab_size` in config.json says how many) restricts drafting to those tokens, so each draft step's LM head
multiplies only their rows of the target's (`tritonllm spec train-eagle --draft-vocab`). Drafts are proposals, so
the target's output stays exactly what it would be; a token outside the vocabulary is just never drafted. Other
EAGLE implementations do not know the key.

`speculative_model_dir: builtin:smollm2` names the EAGLE-1/2 draft shipped for SmolLM2-135M-Instruct
(spec_decode/data/smollm2-eagle, trained with `tritonllm spec train-eagle`; docs/benchmarks.md).

EAGLE-3, the EAGLE repository's (and vLLM's) format: `config.json` (Llama style, `num_hidden_layers: 1`,
`draft_vocab_size`, optional `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`: as in vLLM,
the target layers whose inputs are captured, i.e. the outputs of the layers before them; TensorRT-LLM's
`eagle3_layers_to_capture` and our `capture_layers` name the layers whose outputs are captured) and
`model.safetensors` or `pytorch_model.bin` with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight` and
`d2t` (row i of the draft's head proposes target token `i + d2t[i]`); `t2d` and `embed_tokens.weight` are ignored
(the target's embedding is used). `tritonllm spec train-eagle --eagle3` trains them; none is shipped.

Every reading failure is a CheckpointError (checkpoint_files.py) naming the folder and what is wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from .checkpoint_files import CONFIG_FILE, CheckpointError, read_config, read_weights, resolve_folder

SAFETENSORS_FILE = "model.safetensors"
PICKLE_FILE = "pytorch_model.bin"
BUILTIN_DRAFTS = {"smollm2": "smollm2-eagle"}  # builtin:NAME -> folder under spec_decode/data
# EAGLE-1/2: the draft layer's tensors, and those a folder may hold that the draft does not use.
LAYER_PREFIX = "layers.0."
IGNORED = ("embed_tokens.weight",)
# EAGLE-3: the midlayer's tensors, the draft-to-target offsets, and the tensors it does not use (the draft proposes
# through d2t and embeds with the target's table).
EAGLE3_LAYER_PREFIX = "midlayer."
D2T_KEY = "d2t"
EAGLE3_IGNORED = ("t2d", "embed_tokens.weight")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # the name EAGLE-3 configs give; the layer is Llama's whatever it says
# Target config.json keys that do not describe a draft layer.
TARGET_ONLY_KEYS = (
    "architectures",
    "model_type",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "tie_word_embeddings",
)
_EAGLE3_KEYS = ("midlayer.", "d2t", "t2d")


@dataclass
class DraftFiles:
    """What a draft folder holds: where it is, its config.json and its tensors by checkpoint name."""

    folder: Path
    config: dict[str, Any]
    state: dict[str, torch.Tensor]


def read_eagle_files(model_dir: Union[str, Path]) -> DraftFiles:
    """The EAGLE-1/2 folder `model_dir` (or `builtin:NAME`, a draft shipped here); an EAGLE-3 one is refused."""
    return _read_draft_files(
        model_dir,
        BUILTIN_DRAFTS,
        "EAGLE",
        _EAGLE3_KEYS,
        "an EAGLE-3 draft (tensor {}); decoding_type Eagle loads only EAGLE-1/2 drafts: "
        "use decoding_type: Eagle3 for it",
    )


def read_eagle3_files(model_dir: Union[str, Path]) -> DraftFiles:
    """The EAGLE-3 folder `model_dir`; an EAGLE-1/2 one is refused."""
    return _read_draft_files(
        model_dir,
        {},
        "EAGLE-3",
        LAYER_PREFIX,
        "an EAGLE-1/2 draft (tensor {}); use decoding_type Eagle for it, not Eagle3",
    )


def _read_draft_files(
    model_dir: Union[str, Path],
    builtins: dict[str, str],
    kind: str,
    other_kind_keys: Union[str, tuple[str, ...]],
    refusal: str,
) -> DraftFiles:
    """A `kind` draft folder; a tensor whose name starts with `other_kind_keys` marks the other format, refused
    with `refusal` (its {} is that tensor's name)."""
    folder = resolve_folder(model_dir, builtins, f"{kind} drafts")
    raw = read_config(folder, f"an {kind}", (SAFETENSORS_FILE, PICKLE_FILE))
    state = read_weights(folder, SAFETENSORS_FILE, PICKLE_FILE, kind)
    other = sorted(key for key in state if key.startswith(other_kind_keys))
    if other:
        raise CheckpointError(f"{folder}: " + refusal.format(other[0]))
    return DraftFiles(folder, raw, state)


def write_draft_folder(
    out_dir: Union[str, Path], state: dict[str, torch.Tensor], config: dict[str, Any], dtype: torch.dtype, pickle: bool
) -> Path:
    """An EAGLE (or EAGLE-3) folder: the weights (`model.safetensors`, or `pytorch_model.bin` with `pickle`) and
    `config.json`, one layer in `dtype`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if pickle:
        torch.save(state, out / PICKLE_FILE)
    else:
        save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    config = {key: value for key, value in config.items() if key != "dtype"}  # the target's; ours is below
    config.update(num_hidden_layers=1, torch_dtype=str(dtype).removeprefix("torch."))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


# ---- EAGLE-3 specifics ----------------------------------------------------------------------------------------


def capture_config(capture_layers: Sequence[int]) -> dict[str, Any]:
    """config.json's `eagle_config` for drafts reading the outputs of `capture_layers`: the key names the layers
    whose inputs are these outputs."""
    return {"eagle_aux_hidden_state_layer_ids": [int(layer) + 1 for layer in capture_layers]}


def captured_layers(raw: dict[str, Any], folder: Path) -> Optional[list[int]]:
    """The config's eagle_aux_hidden_state_layer_ids (layers whose inputs feed the draft) as the layers whose
    outputs those inputs are; None if the config has none."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in ids):
        raise CheckpointError(
            f"{folder}: eagle_config.eagle_aux_hidden_state_layer_ids must list target layers "
            f">= 1 (a layer's input is the output of the one before it), got {ids!r}"
        )
    return [i - 1 for i in ids]


def draft_to_target(d2t: Optional[torch.Tensor], draft_vocab_size: int, vocab_size: int, folder: Path) -> torch.Tensor:
    """The target id of each draft-vocabulary row: arange + d2t, checked; without d2t the draft vocabulary must be
    the whole vocabulary."""
    rows = torch.arange(draft_vocab_size)
    if d2t is None:
        if draft_vocab_size != vocab_size:
            raise CheckpointError(
                f"{folder}: EAGLE-3 weights lack {D2T_KEY}, which a draft_vocab_size "
                f"({draft_vocab_size}) other than vocab_size ({vocab_size}) needs"
            )
        return rows
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or len(d2t) != draft_vocab_size:
        raise CheckpointError(
            f"{folder}: EAGLE-3 tensor {D2T_KEY} must hold {draft_vocab_size} integer offsets "
            f"(draft_vocab_size), got shape {list(d2t.shape)} of {d2t.dtype}"
        )
    ids = rows + d2t.to(torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CheckpointError(
            f"{folder}: EAGLE-3 tensor {D2T_KEY} maps draft ids outside the vocabulary [0, {vocab_size})"
        )
    return ids
