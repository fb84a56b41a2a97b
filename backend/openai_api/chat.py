"""Chat prompts rendered with the model's own chat template, and the special tokens that end an assistant turn.

The frontend renders with `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` and sends
the text to the backend model, whose preprocessing step tokenizes it again with `add_special_tokens` (the
repository default). A template that writes the BOS token itself would then get it twice, so a leading BOS is
taken off the rendered text whenever the tokenizer adds one on its own.

Tools go to the template as `apply_chat_template(..., tools=[...])`. What a template does with tools is found by
trying: its tool-call format from its text (`<tool_call>` tags: the Hermes format), and whether it renders the
tool calls of an assistant message by rendering one with a probe name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .errors import BadRequest

# An assistant turn made of only this text shows, in the rendered conversation, what the template writes after
# an assistant's message: its end-of-turn marker.
_SENTINEL = "\u2063tritonllm-end-of-turn-probe\u2063"
_PROBE_FUNCTION = "tritonllm_probe_function"


class ChatTemplate:
    def __init__(self, tokenizer: Any, model_dir: Optional[Path] = None):
        self.tokenizer = tokenizer  # a Hugging Face tokenizer
        self.adds_bos = _adds_bos(tokenizer)
        self.end_of_turn = end_of_turn_tokens(tokenizer, model_dir)
        self.call_format = tool_call_format(tokenizer)
        self.renders_tool_calls = _renders_tool_calls(tokenizer)

    @property
    def available(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> str:
        """The prompt for `messages` (and `tools`), ending with the assistant's turn opened; BadRequest when the
        template refuses the conversation (roles out of order, for one) or cannot show its tool calls."""
        if not self.available:
            raise BadRequest("this model has no chat template: use /v1/completions", param="messages")
        self._check_tool_calls(messages)
        try:
            with_tools = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **with_tools
            )
        except Exception as error:  # jinja2 TemplateError (raise_exception in the template) and friends
            raise BadRequest(
                f"the model's chat template cannot render these messages: {error}", param="messages"
            ) from None
        return self.without_leading_bos(text)

    def _check_tool_calls(self, messages: list[dict[str, Any]]) -> None:
        if self.renders_tool_calls:
            return
        for index, message in enumerate(messages):
            if message.get("tool_calls"):
                raise BadRequest(
                    "this model's chat template cannot show an assistant message's tool_calls (it has no tool "
                    "support): send the calls as the message's content instead",
                    param=f"messages.{index}.tool_calls",
                )

    def without_leading_bos(self, text: str) -> str:
        bos = self.tokenizer.bos_token
        if self.adds_bos and bos and text.startswith(bos):
            return text[len(bos) :]
        return text


def _adds_bos(tokenizer: Any) -> bool:
    bos_id = tokenizer.bos_token_id
    if bos_id is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and ids[0] == bos_id


def tool_call_format(tokenizer: Any) -> Optional[str]:
    """The tool-call format the chat template asks the model to write: "hermes" (`<tool_call>` JSON tags), or
    None when it shows none that is parsed here. A template may be a dict of named templates (`tool_use`)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    texts = template.values() if isinstance(template, dict) else [template]
    return "hermes" if any("<tool_call>" in str(text) for text in texts) else None


def _renders_tool_calls(tokenizer: Any) -> bool:
    if not getattr(tokenizer, "chat_template", None):
        return False
    call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_FUNCTION, "arguments": {}}}
    conversation = [
        {"role": "user", "content": "ping"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:
        return False
    return _PROBE_FUNCTION in text


def end_of_turn_tokens(tokenizer: Any, model_dir: Optional[Path] = None) -> tuple[str, ...]:
    """Special tokens that end the assistant's answer: those the template writes right after an assistant
    message, the tokenizer's EOS, and the EOS ids of generation_config.json."""
    found: list[str] = []
    special = set(tokenizer.all_special_tokens) | _added_special_tokens(tokenizer)
    tail = _text_after_assistant_turn(tokenizer)
    # in the order they appear in the tail
    found += sorted((token for token in special if token and token in tail), key=tail.find)
    if tokenizer.eos_token:
        found.append(tokenizer.eos_token)
    for token_id in _generation_config_eos_ids(model_dir):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token:
            found.append(token)
    return tuple(dict.fromkeys(found))


def _text_after_assistant_turn(tokenizer: Any) -> str:
    if not getattr(tokenizer, "chat_template", None):
        return ""
    conversation = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:
        return ""  # a template that refuses this conversation shape: EOS alone ends the turn
    return text.split(_SENTINEL, 1)[1] if _SENTINEL in text else ""


def _added_special_tokens(tokenizer: Any) -> set[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {token.content for token in decoder.values() if getattr(token, "special", False)}


def _generation_config_eos_ids(model_dir: Optional[Path]) -> list[int]:
    if model_dir is None:
        return []
    path = Path(model_dir) / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    ids = value if isinstance(value, list) else [value]
    return [int(i) for i in ids if isinstance(i, int)]
