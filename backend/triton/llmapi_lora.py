"""The adapter of one LLM-API request: TensorRT-LLM's `lora_id`, `lora_name`, `lora_path` (all three together) and
`lora_ckpt_source`, as its llmapi model reads them, into the engine's LoRARequest.

The adapter folder is read from the server's file system on first use and cached under `lora_id`; later requests
with the same id reuse it. Only Hugging Face PEFT folders (`lora_ckpt_source` "hf", the default) can be read here;
"nemo" checkpoints are refused by name. LoRA must be on in model.yaml (`enable_lora` / `lora_config`)."""

from __future__ import annotations

import os
from typing import Any, Optional

from ..engine.types import LoRARequest
from .llmapi_inputs import read_input
from .pb import InputError, decode_string

LORA_INPUTS = ("lora_id", "lora_name", "lora_path")
CKPT_SOURCES = ("hf", "nemo")


def lora_request(request: Any) -> Optional[LoRARequest]:
    """None when the request names no adapter."""
    values = {name: _scalar(request, name, "UINT64" if name == "lora_id" else "STRING") for name in LORA_INPUTS}
    given = [name for name, value in values.items() if value is not None]
    if not given:
        if _scalar(request, "lora_ckpt_source", "STRING") is not None:
            raise InputError("lora_ckpt_source", "needs lora_id, lora_name and lora_path")
        return None
    missing = [name for name in LORA_INPUTS if values[name] is None]
    if missing:
        names = ", ".join(f"'{name}'" for name in missing)
        raise InputError(
            f"input{'s' if len(missing) > 1 else ''} {names} missing: lora_id, lora_name and lora_path must all be "
            f"provided together (given: {', '.join(given)})"
        )
    check_ckpt_source(request)
    name = decode_string(values["lora_name"], "lora_name")
    path = decode_string(values["lora_path"], "lora_path")
    if not os.path.exists(path):
        raise InputError("lora_path", f"{path!r} does not exist on the Triton server's file system")
    lora_id = values["lora_id"]
    assert lora_id is not None  # checked with the other two above
    return LoRARequest(lora_name=name, lora_int_id=int(lora_id), lora_path=path)


def check_ckpt_source(request: Any) -> None:
    value = _scalar(request, "lora_ckpt_source", "STRING")
    source = "hf" if value is None else decode_string(value, "lora_ckpt_source")
    if source not in CKPT_SOURCES:
        raise InputError("lora_ckpt_source", f"must be one of {list(CKPT_SOURCES)}, got {source!r}")
    if source == "nemo":
        raise InputError(
            "lora_ckpt_source",
            '= "nemo" is not supported: the embedded engine reads Hugging Face PEFT adapter folders ("hf") only',
        )


def _scalar(request: Any, name: str, dtype: str) -> Optional[Any]:
    array = read_input(request, name, dtype)
    if array is None:
        return None
    if array.size != 1:
        raise InputError(name, f"must hold one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]
