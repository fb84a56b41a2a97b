"""OpenAI request bodies: checked fields, the errors naming them, and the typed objects they become."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the OpenAI frontend needs fastapi (ci/requirements.txt)")

from tritonllm.openai_api.errors import BadRequest, ModelNotFound, PromptTooLong, ServiceUnavailable, Unsupported  # noqa: E402
from tritonllm.openai_api.generation import prepare_prompt  # noqa: E402
from tritonllm.openai_api.schemas import (
    ChatCompletionBody,
    CompletionBody,
    chat_max_tokens,
    chat_messages,  # noqa: E402
    check_chat_fields,
    check_completion_fields,
    completion_prompts,
    include_usage,
    parse_body,
    sampling_of,
    stop_strings,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def bad_field(body_class, body) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        parse_body(body_class, body)
    return caught.value


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 2.5),
        ("temperature", -1),
        ("top_p", 0),
        ("n", 0),
        ("n", 17),
        ("max_tokens", 0),
        ("seed", -1),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("stop", ["ok", ""]),
        ("stop", 5),
        ("stream", "sometimes"),
        ("model", ""),
    ],
)
def test_a_bad_value_is_a_400_naming_its_field(field, value):
    error = bad_field(ChatCompletionBody, {**CHAT, field: value})
    assert error.status == 400 and error.param == field and field in error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_nested_fields_are_named_by_their_path():
    error = bad_field(ChatCompletionBody, {**CHAT, "messages": [{"role": "robot", "content": "x"}]})
    assert error.param == "messages.0.role"
    assert bad_field(ChatCompletionBody, {**CHAT, "messages": []}).param == "messages"
    assert bad_field(CompletionBody, {"model": "m"}).param == "prompt"


def test_stream_options_need_stream_and_the_body_must_be_an_object():
    assert (
        "stream_options"
        in bad_field(CompletionBody, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}).message
    )
    assert bad_field(CompletionBody, ["not", "an", "object"]).status == 400


def test_unknown_fields_are_ignored_and_defaults_follow_openai():
    body = parse_body(ChatCompletionBody, {**CHAT, "some_vendor_extra": 1})
    sampling = sampling_of(body, chat_max_tokens(body))
    assert sampling.temperature == 1.0 and sampling.max_tokens is None and sampling.top_p is None
    assert body.n == 1 and stop_strings(body) == () and include_usage(body)


def test_null_fields_count_as_not_sent():
    body = parse_body(
        ChatCompletionBody, {**CHAT, "n": None, "stream": None, "logprobs": None, "stop": None, "temperature": None}
    )
    assert body.n == 1 and body.stream is False and body.logprobs is False and stop_strings(body) == ()


def test_stop_usage_and_extensions():
    body = parse_body(
        CompletionBody,
        {
            "model": "m",
            "prompt": ["a", "b"],
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_k": 5,
            "min_tokens": 2,
            "max_tokens": 8,
            "seed": 7,
            "temperature": 0,
        },
    )
    assert stop_strings(body) == ("END",) and include_usage(body) and completion_prompts(body) == ("a", "b")
    sampling = sampling_of(body, body.max_tokens)
    assert (sampling.top_k, sampling.min_tokens, sampling.seed, sampling.temperature) == (5, 2, 7, 0.0)
    streamed = parse_body(CompletionBody, {"model": "m", "prompt": "a", "stream": True})
    assert not include_usage(streamed)
    assert sampling_of(streamed, None).max_tokens is None
    with pytest.raises(BadRequest, match="min_tokens"):
        sampling_of(parse_body(CompletionBody, {"model": "m", "prompt": "a", "min_tokens": 9, "max_tokens": 8}), 8)


def test_max_completion_tokens_wins_and_must_agree_with_max_tokens():
    assert chat_max_tokens(parse_body(ChatCompletionBody, {**CHAT, "max_completion_tokens": 5})) == 5
    assert chat_max_tokens(parse_body(ChatCompletionBody, {**CHAT, "max_tokens": 6})) == 6
    with pytest.raises(BadRequest) as caught:
        chat_max_tokens(parse_body(ChatCompletionBody, {**CHAT, "max_tokens": 6, "max_completion_tokens": 5}))
    assert caught.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_chat_features_not_built_are_a_422_naming_them(extra, param):
    with pytest.raises(Unsupported) as caught:
        check_chat_fields(parse_body(ChatCompletionBody, {**CHAT, **extra}))
    assert caught.value.status == 422 and caught.value.param == param


@pytest.mark.parametrize(
    "extra, param",
    [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"logprobs": 2}, "logprobs")],
)
def test_completion_features_not_built_are_a_422_naming_them(extra, param):
    with pytest.raises(Unsupported) as caught:
        check_completion_fields(parse_body(CompletionBody, {"model": "m", "prompt": "x", **extra}))
    assert caught.value.param == param


def test_token_id_prompts_and_logit_bias_are_refused():
    with pytest.raises(Unsupported, match="token-id"):
        completion_prompts(parse_body(CompletionBody, {"model": "m", "prompt": [1, 2, 3]}))
    with pytest.raises(Unsupported):
        sampling_of(parse_body(CompletionBody, {"model": "m", "prompt": "x", "logit_bias": {"5": 1.0}}), None)


def test_chat_messages_join_text_parts_and_map_developer_to_system():
    body = parse_body(
        ChatCompletionBody,
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "ann",
                },
            ],
        },
    )
    assert chat_messages(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab", "name": "ann"},
    ]
    image = parse_body(
        ChatCompletionBody,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    )
    with pytest.raises(Unsupported) as caught:
        chat_messages(image)
    assert caught.value.param == "messages.0.content.0"


def test_prompt_budget_against_the_context():
    # Without max_tokens: the default, lowered to what the context leaves (never an error for the default).
    assert prepare_prompt("p", 10, None, 100, "prompt", 16).max_tokens == 16
    assert prepare_prompt("p", 10, None, 100, "prompt", 500).max_tokens == 90
    assert prepare_prompt("p", 10, 90, 100, "prompt", 16).max_tokens == 90
    with pytest.raises(PromptTooLong) as caught:
        prepare_prompt("p", 10, 91, 100, "prompt", 16)
    assert caught.value.param == "max_tokens" and caught.value.code == "context_length_exceeded"
    with pytest.raises(PromptTooLong) as caught:
        prepare_prompt("p", 100, None, 100, "messages", 16)
    assert caught.value.param == "messages" and caught.value.status == 400


def test_error_statuses_and_shapes():
    assert ModelNotFound("x").status == 404 and ModelNotFound("x").body()["error"]["code"] == "model_not_found"
    assert ServiceUnavailable("down").status == 503
    assert Unsupported("no").status == 422
