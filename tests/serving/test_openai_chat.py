"""Chat templates: the frontend's prompt is the model's own template with the generation prompt, and the
template's end-of-turn tokens stop generation."""

from __future__ import annotations

import json

import pytest

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.openai_api.chat import ChatTemplate, end_of_turn_tokens
from tritonllm.openai_api.errors import BadRequest

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]

LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def test_multi_turn_prompt_with_a_system_message_is_the_models_template(tokenizer, tiny_dir):
    expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    rendered = ChatTemplate(tokenizer, tiny_dir).render(CONVERSATION)
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n") and "You answer in one word." in rendered


def test_chatml_end_of_turn_is_im_end(tokenizer, tiny_dir):
    assert end_of_turn_tokens(tokenizer, tiny_dir) == ("<|im_end|>",)


def test_template_end_of_turn_token_and_generation_config_eos_ids(tokenizer, tiny_dir, tmp_path):
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]}
    )
    tokenizer.chat_template = LLAMA3_STYLE
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    stops = end_of_turn_tokens(tokenizer, tmp_path)
    assert stops[0] == "<|eot_id|>" and set(stops) == {"<|eot_id|>", "<|im_end|>", "<|endoftext|>"}


class BosAddingTokenizer:
    """The parts of a Llama-style tokenizer the template code uses: it adds BOS itself, and its template
    writes BOS too."""

    bos_token, bos_token_id, eos_token = "<s>", 1, "</s>"
    all_special_tokens = ["<s>", "</s>"]
    chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"

    def encode(self, text, add_special_tokens=True):
        ids = [1] if add_special_tokens else []
        while text:
            if text.startswith(self.bos_token):  # special tokens in the text are parsed, as HF tokenizers do
                ids.append(self.bos_token_id)
                text = text[len(self.bos_token) :]
            else:
                ids.append(ord(text[0]))
                text = text[1:]
        return ids

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "<s>" + "".join(f"[{m['content']}]" for m in messages) + ("</s>" if not add_generation_prompt else "")


def test_a_bos_the_tokenizer_adds_itself_is_not_sent_twice():
    tokenizer = BosAddingTokenizer()
    template = ChatTemplate(tokenizer)
    assert template.adds_bos
    rendered = template.render(CONVERSATION)
    full = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert rendered == full[len("<s>") :]
    # preprocessing tokenizes with add_special_tokens: the engine sees the template's ids, one BOS
    assert tokenizer.encode(rendered) == tokenizer.encode(full, add_special_tokens=False)


def test_a_template_that_refuses_the_messages_is_a_400(tokenizer, tiny_dir):
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(BadRequest, match="roles must alternate") as caught:
        ChatTemplate(tokenizer, tiny_dir).render(CONVERSATION)
    assert caught.value.param == "messages"


def test_no_template_is_a_400(tokenizer, tiny_dir):
    tokenizer.chat_template = None
    with pytest.raises(BadRequest, match="no chat template"):
        ChatTemplate(tokenizer, tiny_dir).render(CONVERSATION)


# A Hermes-style template (as Qwen2.5's): tools listed in a system turn, calls written as <tool_call> JSON.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
CALL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_a_hermes_template_gets_the_tools_and_shows_past_calls(tokenizer, tiny_dir):
    tokenizer.chat_template = HERMES_TEMPLATE
    template = ChatTemplate(tokenizer, tiny_dir)
    assert template.call_format == "hermes" and template.renders_tool_calls
    rendered = template.render(CALL_HISTORY, [TOOL])
    assert '"name": "get_weather"' in rendered and "Tools:" in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert "<|im_start|>tool\nsunny<|im_end|>" in rendered


def test_a_template_without_tool_support_cannot_show_past_calls(tokenizer, tiny_dir):
    template = ChatTemplate(tokenizer, tiny_dir)  # the tiny model's ChatML has no tools
    assert template.call_format is None and not template.renders_tool_calls
    assert "get_weather" not in template.render(CALL_HISTORY[:1], [TOOL])  # the tools are ignored
    with pytest.raises(BadRequest, match="tool_calls") as caught:
        template.render(CALL_HISTORY, [TOOL])
    assert caught.value.param == "messages.1.tool_calls"
