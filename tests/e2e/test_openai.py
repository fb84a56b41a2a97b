"""The OpenAI-compatible endpoint on the real tritonserver (tiny model), driven by the official `openai` client:
chat and text completions streamed and whole, n, stop strings, usage against the tokenizer and the engine,
errors in OpenAI's shape, and a stream closed early cancelling its Triton request."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the OpenAI endpoint tests need the openai client")

import e2e_clients as clients  # noqa: E402

from tritonllm.deploy.frontend import FrontendProcess  # noqa: E402
from tritonllm.deploy.tritonserver import free_port  # noqa: E402

pytestmark = pytest.mark.server

MODEL = "tiny"
LORA = "tiny-adapter"
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And the capital of Italy?"},
]
PROMPT = "The lamp turned and turned"


def start_frontend(server, tiny_model: Path, log_dir: Path, *extra: str) -> FrontendProcess:
    return FrontendProcess(
        server.triton.grpc_url,
        tiny_model,
        free_port(),
        log_file=log_dir / "openai.log",
        extra=["--served-model-name", MODEL, *extra],
    ).start()


@pytest.fixture(scope="module")
def frontend(server, tiny_model, tmp_path_factory):
    process = start_frontend(server, tiny_model, tmp_path_factory.mktemp("openai"), "--lora-name", LORA)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def ensemble_frontend(server, tiny_model, tmp_path_factory):
    process = start_frontend(
        server, tiny_model, tmp_path_factory.mktemp("openai_ensemble"), "--backend-model", "ensemble"
    )
    yield process
    process.stop()


@pytest.fixture
def client(frontend):
    with openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client, stream=False, **fields):
    return client.chat.completions.create(model=MODEL, messages=CONVERSATION, stream=stream, **fields)


def joined_chat_deltas(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return texts, reasons, usage


# ---------------------------------------------------------------------------------------------- models


def test_models_lists_the_served_model_and_lora_names(client):
    assert [model.id for model in client.models.list()] == [MODEL, LORA]
    assert client.models.retrieve(LORA).id == LORA


def test_health_is_ready_and_metrics_count_requests(frontend, client):
    chat(client, max_tokens=4, temperature=0)
    connection = http.client.HTTPConnection("localhost", frontend.port, timeout=30)
    try:
        connection.request("GET", "/health")
        health = connection.getresponse()
        assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    samples = {
        (s.name, s.labels.get("status")): s.value
        for s in clients.parse_samples(text)
        if s.labels.get("model") in (MODEL, None)
    }
    assert samples[("tritonllm_openai_requests_total", "200")] >= 1
    assert any(name == "tritonllm_openai_completion_tokens_total" for name, _ in samples)


# ---------------------------------------------------------------------------------------------- chat


def test_chat_usage_and_text_are_the_engines_for_the_templated_prompt(server, client, tokenizer):
    """The prompt the engine saw is the model's template applied to the conversation: its token count is the
    tokenizer's, and the greedy answer is the engine's own greedy answer for those token ids."""
    prompt_ids = tokenizer.hf.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):  # transformers 5 returns an encoding
        prompt_ids = prompt_ids["input_ids"]
    expected_ids = clients.greedy_token_ids(server, list(prompt_ids), 24, tokenizer.end_id)
    answer = chat(client, max_tokens=24, temperature=0)
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.completion_tokens == len(expected_ids)
    assert answer.usage.total_tokens == len(prompt_ids) + len(expected_ids)
    assert answer.choices[0].message.content == tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert answer.choices[0].finish_reason == ("length" if len(expected_ids) == 24 else "stop")


def test_chat_streamed_deltas_join_to_the_whole_answer(client):
    whole = chat(client, max_tokens=20, temperature=0)
    texts, reasons, usage = joined_chat_deltas(
        chat(client, stream=True, max_tokens=20, temperature=0, stream_options={"include_usage": True})
    )
    assert texts == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_n2_gives_two_independent_reproducible_samples(client):
    first = chat(client, n=2, max_tokens=12, temperature=1.0, seed=11)
    again = chat(client, n=2, max_tokens=12, temperature=1.0, seed=11)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1]
    assert texts[0] != texts[1], "two samples of the same prompt came out identical"
    assert texts == [choice.message.content for choice in again.choices]
    streamed, _, _ = joined_chat_deltas(chat(client, stream=True, n=2, max_tokens=12, temperature=1.0, seed=11))
    assert streamed == {0: texts[0], 1: texts[1]}


def test_chat_logprobs_one_per_generated_token(client):
    answer = chat(client, max_tokens=8, temperature=0, logprobs=True)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert all(entry.logprob <= 0 for entry in content)


# ---------------------------------------------------------------------------------------------- text completions


def test_text_completion_streamed_and_whole_agree(client, tokenizer):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=True))
    pieces, reason = [], None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
    assert "".join(pieces) == whole.choices[0].text and reason == whole.choices[0].finish_reason


def test_stop_string_ends_the_text_before_it(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = stop_string_in(text)
    cut = text[: text.find(stop)]
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert answer.choices[0].text == cut and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens < 24
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == cut


def stop_string_in(text: str) -> str:
    """Three plain characters from the middle of `text`, at their first occurrence."""
    for start in range(3, len(text) - 3):
        candidate = text[start : start + 3]
        if candidate.isascii() and candidate.strip() and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}: pick another prompt")


# ---------------------------------------------------------------------------------------------- errors


def test_unknown_model_is_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_bad_fields_and_long_prompts_are_400s_naming_the_field(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", temperature=3)
    assert caught.value.response.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=server.max_seq_len)
    assert caught.value.response.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_default_and_limit(server, tiny_model, tmp_path):
    """--max-tokens-default for a request without max_tokens (the engine generated no more), --max-tokens-limit
    refused with a 400 naming the field; min_tokens pins the default's count (random weights may end early)."""
    process = start_frontend(server, tiny_model, tmp_path, "--max-tokens-default", "5", "--max-tokens-limit", "12")
    try:
        with openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            plain = chat(c, temperature=0)
            assert plain.usage.completion_tokens <= 5
            pinned = c.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"min_tokens": 5})
            assert pinned.usage.completion_tokens == 5 and pinned.choices[0].finish_reason == "length"
            assert chat(c, temperature=0, max_tokens=12).usage.completion_tokens <= 12
            with pytest.raises(openai.BadRequestError) as caught:
                chat(c, temperature=0, max_tokens=13)
            error = caught.value.response.json()["error"]
            assert error["param"] == "max_tokens" and "at most 12" in error["message"]
    finally:
        process.stop()


# ---------------------------------------------------------------------------------------------- cancellation


def test_closing_a_stream_early_cancels_the_triton_request(server, client, tokenizer):
    before = server.wait_engine_idle()
    assert clients.engine_is_idle(before), f"the engine is busy before the test: {before}"
    max_tokens = server.max_seq_len - len(tokenizer.encode(PROMPT, add_special_tokens=True)) - 1
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"min_tokens": max_tokens},
    )
    received = []
    for chunk in stream:
        received.append(chunk)
        if len(received) == 5:
            break
    stream.close()
    assert all(chunk.choices[0].finish_reason is None for chunk in received)
    clients.assert_cut_short(server, before, max_tokens)


# ---------------------------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_prefetch_dir(tiny_model, tmp_path_factory):
    """One PEFT adapter, `fr`, with random weights, for conftest's lora_server to preload by name."""
    peft = pytest.importorskip("peft", reason="the LoRA test builds its adapter with peft")
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    adapter = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    folder = tmp_path_factory.mktemp("openai_lora")
    adapter.save_pretrained(folder / "fr")
    return folder


def test_a_lora_name_is_answered_by_its_adapter(lora_server, tiny_model, tmp_path_factory):
    frontend = start_frontend(
        lora_server, tiny_model, tmp_path_factory.mktemp("openai_lora_frontend"), "--lora-name", "fr"
    )
    try:
        with openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            assert [model.id for model in c.models.list()] == [MODEL, "fr"]
            via_adapter = c.completions.create(model="fr", prompt=PROMPT, max_tokens=12, temperature=0)
            via_base = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    finally:
        frontend.stop()
    direct = lora_server.stream_infer(
        "tensorrt_llm_bls",
        {
            "text_input": clients.strings(PROMPT),
            "max_tokens": clients.scalar(12, np.int32),
            "stream": clients.scalar(True, np.bool_),
            "exclude_input_in_output": clients.scalar(True, np.bool_),
            "lora_name": clients.strings("fr"),
        },
    )
    assert direct.error is None, direct.error
    assert via_adapter.choices[0].text == "".join(direct.texts())
    assert via_adapter.choices[0].text != via_base.choices[0].text, "the adapter changed nothing: pick a bigger one"


# ---------------------------------------------------------------------------------------------- ensemble


def test_the_ensemble_backend_gives_the_same_text(client, ensemble_frontend):
    with openai.OpenAI(
        base_url=f"{ensemble_frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as ensemble:
        via_ensemble = chat(ensemble, max_tokens=16, temperature=0)
        streamed, _, _ = joined_chat_deltas(chat(ensemble, stream=True, max_tokens=16, temperature=0))
    via_bls = chat(client, max_tokens=16, temperature=0)
    assert via_ensemble.choices[0].message.content == via_bls.choices[0].message.content == streamed[0]
    assert via_ensemble.usage == via_bls.usage


def test_sse_stream_ends_with_done(frontend):
    connection = http.client.HTTPConnection("localhost", frontend.port, timeout=60)
    try:
        connection.request(
            "POST",
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}),
            {"Content-Type": "application/json"},
        )
        lines = [line for line in connection.getresponse().read().decode().split("\n") if line]
    finally:
        connection.close()
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
