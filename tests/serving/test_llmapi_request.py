"""Request conversion of the LLM-API model (contract 1.3 inputs -> prompt + SamplingParams), against a fake
pb_utils; every refusal names the input."""

from __future__ import annotations

import sys

import fake_pb_utils as fake  # registered by conftest.py
import numpy as np
import pytest

from tritonllm.triton.llmapi_request import convert_request, name_inputs
from tritonllm.triton.pb import InputError


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


class CharTokenizer:
    """One token per character (its code point); end id 2, pad id 0."""

    end_id, pad_id = 2, 0

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


TYPES = {bool: np.bool_, int: np.int32, float: np.float32}


def request(prompt="Hi", **inputs) -> fake.InferenceRequest:
    tensors = {} if prompt is None else {"text_input": np.array([prompt.encode()], dtype=object)}
    for name, value in inputs.items():
        tensors[name] = value if isinstance(value, np.ndarray) else np.array([value], dtype=TYPES[type(value)])
    return fake.InferenceRequest(tensors)


def convert(decoupled=True, **kwargs):
    return convert_request(request(**kwargs), CharTokenizer(), decoupled)


def test_defaults_follow_tensorrt_llm_sampling_params():
    job = convert()
    assert job.prompt == "Hi" and job.prompt_token_ids == [1, ord("H"), ord("i")]
    assert job.params.max_tokens == 32 and job.params.n == 1
    assert job.params.end_id == 2 and job.params.pad_id == 0
    assert not job.streaming and not job.exclude_input and job.best_of == 1 and job.stop == []
    assert not job.params.logprobs and job.params.greedy


def test_sampling_inputs_reach_the_engine_params():
    job = convert(
        sampling_param_temperature=0.5,
        sampling_param_top_k=4,
        sampling_param_top_p=0.9,
        sampling_param_frequency_penalty=0.1,
        sampling_param_presence_penalty=0.2,
        sampling_param_max_tokens=7,
        sampling_param_seed=np.array([2**40], dtype=np.uint64),
        sampling_param_exclude_input_from_output=True,
        streaming=True,
    )
    params = job.params
    assert (params.temperature, params.top_k, params.max_tokens, params.seed) == (0.5, 4, 7, 2**40)
    assert params.top_p == pytest.approx(0.9) and params.frequency_penalty == pytest.approx(0.1)
    assert params.presence_penalty == pytest.approx(0.2)
    assert job.exclude_input and job.streaming


def test_stop_strings_become_token_level_stop_words_too():
    job = convert(sampling_param_stop=np.array([b"ab", b"", b"c"], dtype=object))
    assert job.stop == ["ab", "c"]
    assert job.params.stop_words == [[ord("a"), ord("b")], [ord("c")]]


def test_cumulative_logprob_and_best_of_turn_log_probs_on():
    assert convert(return_cumulative_logprob=True).params.logprobs
    job = convert(sampling_param_best_of=3)
    assert job.params.logprobs and job.params.n == 3 and job.best_of == 3
    assert convert(return_finish_reason=True, return_stop_reason=True).outputs.finish_reason


@pytest.mark.parametrize(
    "inputs, named",
    [
        (dict(prompt=None), "text_input"),
        (dict(prompt="x", sampling_param_max_tokens=0), "sampling_param_max_tokens"),
        (dict(sampling_param_top_p=0.0), "sampling_param_top_p"),
        (dict(sampling_param_temperature=-1.0), "sampling_param_temperature"),
        (dict(sampling_param_top_k=-2), "sampling_param_top_k"),
        (dict(sampling_param_best_of=0), "sampling_param_best_of"),
        (dict(sampling_param_best_of=2, streaming=True), "sampling_param_best_of"),
        (dict(sampling_param_max_tokens=np.array([3, 4], dtype=np.int32)), "sampling_param_max_tokens"),
        (dict(sampling_param_max_tokens=np.array([3.0], dtype=np.float32)), "sampling_param_max_tokens"),
    ],
)
def test_bad_inputs_are_refused_naming_the_input(inputs, named):
    with pytest.raises(InputError, match=f"'{named}'"):
        convert(**inputs)


def test_a_two_dimensional_prompt_is_refused():
    bad = fake.InferenceRequest({"text_input": np.array([[b"a"]], dtype=object)})
    with pytest.raises(InputError, match="'text_input' must be a 1-D tensor"):
        convert_request(bad, CharTokenizer(), True)


def test_streaming_needs_decoupled_mode():
    with pytest.raises(InputError, match="'streaming'.*decoupled"):
        convert(decoupled=False, streaming=True)
    assert not convert(decoupled=False, streaming=False).streaming


def test_engine_messages_get_the_inputs_they_are_about():
    assert (
        name_inputs("prompt length 9 + max_tokens 300 = 309 exceeds max_seq_len 256")
        == "inputs 'text_input', 'sampling_param_max_tokens': prompt length 9 + max_tokens 300 = 309 exceeds "
        "max_seq_len 256"
    )
    assert name_inputs("the engine is tired") == "the engine is tired"


def strings(*values: str) -> np.ndarray:
    return np.array([value.encode() for value in values], dtype=object)


def test_return_perf_metrics_reaches_the_engine_params_and_the_output_options():
    job = convert(sampling_param_return_perf_metrics=True)
    assert job.params.return_perf_metrics and job.outputs.perf_metrics
    assert not convert().params.return_perf_metrics


def test_a_lora_adapter_is_read_from_lora_id_name_and_path_together(tmp_path):
    job = convert(lora_id=np.array([7], dtype=np.uint64), lora_name=strings("mine"), lora_path=strings(str(tmp_path)))
    assert (job.lora.lora_int_id, job.lora.lora_name, job.lora.lora_path) == (7, "mine", str(tmp_path))
    assert convert().lora is None


ADAPTER = {"lora_id": np.array([7], dtype=np.uint64), "lora_name": "mine", "lora_path": "{tmp}"}


@pytest.mark.parametrize(
    "inputs, message",
    [
        (dict(lora_name="mine"), "inputs 'lora_id', 'lora_path' missing: lora_id, lora_name and lora_path must all"),
        (dict(lora_ckpt_source="hf"), "input 'lora_ckpt_source' needs lora_id, lora_name and lora_path"),
        ({**ADAPTER, "lora_ckpt_source": "nemo"}, "input 'lora_ckpt_source' = \"nemo\" is not supported"),
        ({**ADAPTER, "lora_ckpt_source": "zip"}, "input 'lora_ckpt_source' must be one of ['hf', 'nemo'], got 'zip'"),
        ({**ADAPTER, "lora_path": "/no/such/adapter"}, "input 'lora_path' '/no/such/adapter' does not exist"),
    ],
)
def test_lora_inputs_are_refused_by_name(tmp_path, inputs, message):
    tensors = {
        name: strings(value.replace("{tmp}", str(tmp_path))) if isinstance(value, str) else value
        for name, value in inputs.items()
    }
    with pytest.raises(InputError) as caught:
        convert(**tensors)
    assert message in str(caught.value)


@pytest.mark.parametrize("name", ["image_url", "sampling_param_logits_post_processor_name"])
def test_inputs_the_engine_cannot_serve_are_refused_by_name(name):
    with pytest.raises(InputError, match=f"input '{name}' cannot be served"):
        convert(**{name: strings("anything")})
    assert convert(**{name: strings("")}).prompt == "Hi"  # empty counts as absent, as in TensorRT-LLM


def test_engine_lora_refusals_name_the_lora_inputs():
    message = name_inputs("this request names a LoRA adapter but LoRA is not enabled (set enable_lora: true)")
    assert message.startswith("inputs 'lora_id', 'lora_name', 'lora_path': ")


def batched(**tensors) -> fake.InferenceRequest:
    """A request to a model with max_batch_size > 0: Triton prepends the batch dimension to every input."""
    return fake.InferenceRequest({name: np.asarray(value)[None] for name, value in tensors.items()})


def test_with_a_batch_dimension_one_prompt_per_request_is_read_as_without_it():
    tensors = {
        "text_input": np.array([b"Hi"], dtype=object),
        "sampling_param_max_tokens": np.array([5], dtype=np.int32),
        "streaming": np.array([True]),
        "sampling_param_stop": np.array([b"x", b"y"], dtype=object),
    }
    job = convert_request(batched(**tensors), CharTokenizer(), decoupled=True, batched=True)
    plain = convert_request(fake.InferenceRequest(tensors), CharTokenizer(), decoupled=True)
    assert (job.prompt, job.params, job.streaming, job.stop) == (plain.prompt, plain.params, True, ["x", "y"])
    assert job.outputs.batch_dim and not plain.outputs.batch_dim


def test_a_batch_of_several_prompts_is_refused_by_name():
    request = fake.InferenceRequest({"text_input": np.array([[b"Hi"], [b"Ho"]], dtype=object)})
    with pytest.raises(InputError, match="input 'text_input' carries a batch of 2 .*one prompt per request"):
        convert_request(request, CharTokenizer(), decoupled=True, batched=True)
