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
