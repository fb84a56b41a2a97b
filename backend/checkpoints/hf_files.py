"""Writing Hugging Face model folders that both transformers 4.57 and 5.x read the same way.

transformers 5.x writes some files that 4.57 misreads (two silently), so configs pass through these fixes:
`rope_theta` also at the top level, `torch_dtype` next to `dtype`, a tokenizer class and input names 4.57 knows,
and no `extra_special_tokens` list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# ChatML, the format of SmolLM2-Instruct and Qwen chat models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]
# Keys transformers 5.x adds to tokenizer_config.json that say nothing about the tokenizer itself.
_TOKENIZER_KEYS_5X_ONLY = ("backend", "is_local", "local_files_only", "extra_special_tokens")


def write_json(path: Path, data: Any) -> None:
    """Deterministic JSON: sorted keys, fixed indent, UTF-8 kept readable, trailing newline."""
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    Path(path).write_text(text, encoding="utf-8")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def portable_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json both 4.x (top-level `rope_theta`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`) read."""
    config = dict(config)
    rope = dict(config.get("rope_parameters") or {})
    theta = rope.get("rope_theta", config.get("rope_theta"))
    by_layer_type = "full_attention" in rope  # Gemma 3: one set a layer type, written out in full already
    if theta is not None and not by_layer_type:
        config["rope_theta"] = theta
        rope.setdefault("rope_theta", theta)
        rope.setdefault("rope_type", "default")
        config["rope_parameters"] = rope
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype is not None:
        config["dtype"] = config["torch_dtype"] = dtype
    return config


def portable_tokenizer_config(config: dict[str, Any], chat_template: str | None = None) -> dict[str, Any]:
    config = {key: value for key, value in config.items() if key not in _TOKENIZER_KEYS_5X_ONLY}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_input_names"] = list(MODEL_INPUT_NAMES)
    config.setdefault("clean_up_tokenization_spaces", False)
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def special_tokens_map(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    keys = ("bos_token", "eos_token", "pad_token", "unk_token")
    return {key: tokenizer_config[key] for key in keys if tokenizer_config.get(key) is not None}
