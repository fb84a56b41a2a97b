"""Guided decoding on the Triton side, without a server: the tensorrt_llm inputs guided_decoding_guide_type /
guided_decoding_guide parsed per row into SamplingParams.guided_decoding (every bad pair an error naming the input),
engine refusals of a guide named by the input on the tiny model's real engine, the load-time parameters
(guided_decoding_backend, tokenizer_dir, xgrammar_tokenizer_info_path), the BLS forwarding them, and the repository
builder filling guided_decoding_backend."""

from __future__ import annotations

import json
import logging
import sys
import time

import fake_pb_utils as fake  # registered by conftest.py
import numpy as np
import pytest

from tritonllm.bls.request import read_request
from tritonllm.deploy.repo import RepoError, build_repo
from tritonllm.engine.types import GuidedDecodingParams
from tritonllm.triton.engine_args import load_tensorrt_llm_settings
from tritonllm.triton.llm_request import convert_request
from tritonllm.triton.params import ParameterError
from tritonllm.triton.pb import InputError

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


def llm_request(rows: int = 1, **inputs) -> fake.InferenceRequest:
    values = {
        "input_ids": np.array([[5, 6, 7]] * rows, np.int32),
        "input_lengths": np.array([[3]] * rows, np.int32),
        "request_output_len": np.array([[4]] * rows, np.int32),
        **inputs,
    }
    return fake.InferenceRequest(values)


def strings(*values: str) -> np.ndarray:
    return np.array([[value] for value in values], dtype=object)


def guides(**inputs) -> list:
    return [row.params.guided_decoding for row in convert_request(llm_request(**inputs), False, True)]


# ------------------------------------------------------------------------------------------------ tensorrt_llm


@pytest.mark.parametrize(
    "guide_type, guide, expected",
    [
        ("json", "", GuidedDecodingParams(json_object=True)),
        ("json", "ignored", GuidedDecodingParams(json_object=True)),
        ("json_schema", SCHEMA, GuidedDecodingParams(json=SCHEMA)),
        ("regex", "[ab]+", GuidedDecodingParams(regex="[ab]+")),
        ("ebnf_grammar", 'root ::= "x"', GuidedDecodingParams(grammar='root ::= "x"')),
        ("structural_tag", '{"a": 1}', GuidedDecodingParams(structural_tag='{"a": 1}')),
    ],
)
def test_each_guide_type_becomes_the_rows_guided_decoding(guide_type, guide, expected):
    assert guides(guided_decoding_guide_type=strings(guide_type), guided_decoding_guide=strings(guide)) == [expected]


def test_no_guide_or_empty_strings_leave_the_row_unguided():
    assert guides() == [None]
    assert guides(guided_decoding_guide_type=strings(""), guided_decoding_guide=strings("")) == [None]


def test_each_batch_row_has_its_own_guide():
    rows = guides(rows=2, guided_decoding_guide_type=strings("regex", ""), guided_decoding_guide=strings("a|b", ""))
    assert rows == [GuidedDecodingParams(regex="a|b"), None]


@pytest.mark.parametrize(
    "inputs, named, why",
    [
        ({"guided_decoding_guide_type": strings("yaml")}, "guided_decoding_guide_type", "must be one of json"),
        ({"guided_decoding_guide": strings("a+")}, "guided_decoding_guide", "needs input 'guided_decoding_guide_type'"),
        ({"guided_decoding_guide_type": strings("regex")}, "guided_decoding_guide", "is required with"),
        (
            {"guided_decoding_guide_type": strings("json_schema"), "guided_decoding_guide": strings("{not json")},
            "guided_decoding_guide",
            "not valid JSON",
        ),
    ],
)
def test_a_bad_pair_is_an_error_naming_the_input(inputs, named, why):
    with pytest.raises(InputError, match=f"input '{named}'.*{why}"):
        convert_request(llm_request(**inputs), False, True)


# ------------------------------------------------------------------------------------------------ the engine's refusals


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tritonllm.checkpoints.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _engine(tiny_dir, backend):
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.embedded.engine import EmbeddedEngine

    return EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(tiny_dir),
                "device": "cpu",
                "dtype": "float32",
                "max_seq_len": 128,
                "max_num_tokens": 128,
                "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 1024},
                "guided_decoding_backend": backend,
                "cuda_graph_config": None,
            }
        )
    )


def _answers(engine, *requests) -> list:
    """Each request's responses, submitted one after the other to one tensorrt_llm in-flight set."""
    from tritonllm.triton.llm_inflight import LLMInflightRequests

    inflight = LLMInflightRequests(engine, decoupled=True, exclude_input_in_output=True, cancellation_check_ms=10)
    try:
        for request in requests:
            inflight.submit(request)
        deadline = time.monotonic() + 60
        while not all(r.get_response_sender().finished for r in requests) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        inflight.stop_sending(5)
    return [r.get_response_sender().sent for r in requests]


def _error(sent) -> str:
    ((response, _flags),) = sent
    assert response.has_error()
    return response.error().message()


def test_a_guide_that_does_not_compile_is_named_and_the_other_requests_run(tiny_dir):
    engine = _engine(tiny_dir, "xgrammar")
    try:
        bad_regex = llm_request(guided_decoding_guide_type=strings("regex"), guided_decoding_guide=strings("[a-"))
        bad_schema = llm_request(
            guided_decoding_guide_type=strings("json_schema"), guided_decoding_guide=strings('{"type": "no-type"}')
        )
        good = llm_request(guided_decoding_guide_type=strings("regex"), guided_decoding_guide=strings("(ab)+"))
        plain = llm_request()
        sent = _answers(engine, bad_regex, good, bad_schema, plain)
    finally:
        engine.shutdown()
    assert "input 'guided_decoding_guide' (guided_decoding_guide_type = 'regex')" in _error(sent[0])
    assert "does not compile" in _error(sent[0])
    assert "input 'guided_decoding_guide' (guided_decoding_guide_type = 'json_schema')" in _error(sent[2])
    for answer in (sent[1], sent[3]):
        assert answer and all(response is None or not response.has_error() for response, _ in answer)
    tokens = [
        int(t)
        for response, _ in sent[1]
        if response is not None
        for t in fake.get_output_tensor_by_name(response, "output_ids").as_numpy().reshape(-1)
    ]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tiny_dir).decode([t for t in tokens if t >= 0])
    assert text and set(text) <= {"a", "b"}, text  # 4 tokens of (ab)+, guided through the in-flight set


def test_a_guided_request_to_a_model_without_the_backend_says_what_to_set(tiny_dir):
    engine = _engine(tiny_dir, None)
    try:
        (sent,) = _answers(engine, llm_request(guided_decoding_guide_type=strings("json")))
    finally:
        engine.shutdown()
    message = _error(sent)
    assert "input 'guided_decoding_guide'" in message
    assert "model.yaml" in message and "config.pbtxt parameter guided_decoding_backend" in message


# ------------------------------------------------------------------------------------------------ load-time parameters


def triton_config(**params: str) -> dict:
    values = {"gpt_model_path": "/models/tiny", **params}
    return {
        "name": "tensorrt_llm",
        "max_batch_size": 8,
        "model_transaction_policy": {"decoupled": True},
        "parameters": {key: {"string_value": value} for key, value in values.items()},
    }


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("LLM_CONFIG_PATH", raising=False)
    (tmp_path / "1").mkdir()
    return tmp_path


def test_the_backend_parameter_reaches_the_engine_config(model_dir):
    load = load_tensorrt_llm_settings
    assert load(triton_config(guided_decoding_backend="xgrammar"), model_dir).engine.guided_decoding_backend == (
        "xgrammar"
    )
    for unset in ("", "${guided_decoding_backend}"):
        assert load(triton_config(guided_decoding_backend=unset), model_dir).engine.guided_decoding_backend is None
    # llguidance is TensorRT-LLM's; the embedded engine refuses it at start (EngineConfig.embedded_unsupported).
    engine = load(triton_config(guided_decoding_backend="llguidance"), model_dir).engine
    assert any("llguidance" in problem for problem in engine.embedded_unsupported())


def test_a_model_yaml_backend_is_overridden_by_the_parameter(model_dir):
    (model_dir / "1" / "model.yaml").write_text("guided_decoding_backend: xgrammar\n")
    assert load_tensorrt_llm_settings(triton_config(), model_dir).engine.guided_decoding_backend == "xgrammar"
    settings = load_tensorrt_llm_settings(triton_config(guided_decoding_backend="llguidance"), model_dir)
    assert settings.engine.guided_decoding_backend == "llguidance"


def test_another_backend_value_is_an_error_naming_the_parameter(model_dir):
    with pytest.raises(ParameterError, match="parameter 'guided_decoding_backend' = 'outlines' must be one of"):
        load_tensorrt_llm_settings(triton_config(guided_decoding_backend="outlines"), model_dir)


def test_tokenizer_dir_is_the_grammars_tokenizer(model_dir):
    engine = load_tensorrt_llm_settings(
        triton_config(guided_decoding_backend="xgrammar", tokenizer_dir="/tok"), model_dir
    ).engine
    assert engine.tokenizer == "/tok"  # the embedded engine builds xgrammar's vocabulary from it


def test_the_xgrammar_tokenizer_info_path_is_accepted_with_one_warning(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="tritonllm.tensorrt_llm"):
        load_tensorrt_llm_settings(triton_config(xgrammar_tokenizer_info_path="/info.json"), model_dir)
        load_tensorrt_llm_settings(triton_config(), model_dir)
    warnings = [r.getMessage() for r in caplog.records if "xgrammar_tokenizer_info_path" in r.getMessage()]
    assert len(warnings) == 1 and "ignored" in warnings[0]


# ------------------------------------------------------------------------------------------------ BLS


def bls_request(**inputs):
    values = {"text_input": np.array([["Hello"]], object), "max_tokens": np.array([[8]], np.int32), **inputs}
    return fake.InferenceRequest({name: np.asarray(value) for name, value in values.items()})


def test_the_bls_forwards_both_inputs_to_tensorrt_llm():
    request = read_request(
        bls_request(guided_decoding_guide_type=strings("json_schema"), guided_decoding_guide=strings(SCHEMA)),
        decoupled=True,
    )
    llm = request.llm_inputs({"INPUT_ID": np.zeros((1, 3), np.int32)})
    assert [bytes(v).decode() for v in llm["guided_decoding_guide_type"].reshape(-1)] == ["json_schema"]
    assert json.loads(bytes(llm["guided_decoding_guide"].reshape(-1)[0]).decode()) == json.loads(SCHEMA)
    assert llm["guided_decoding_guide"].shape == (1, 1)


class Recorder:
    """A tensorrt_llm stand-in for the draft/target loop: answers `count` tokens 7, 8, 9, ... after the context
    (every draft right), and keeps each call's inputs."""

    def __init__(self):
        self.calls = []

    def start(self, inputs, request_id):
        self.calls.append(inputs)
        return self

    def responses(self):
        from tritonllm.bls.llm_calls import LlmResponse

        inputs = self.calls[-1]
        context = inputs["input_ids"][0].tolist()
        count = int(inputs["request_output_len"].item())
        out = [7 + len(context) - 3 + i for i in range(count)]
        yield LlmResponse(
            {"output_ids": np.array(out, np.int32).reshape(1, 1, -1), "sequence_length": np.array([[count]])}, True
        )

    def cancel(self):
        pass


def test_the_bls_draft_target_loop_guides_the_target_past_the_tokens_so_far():
    from tritonllm.bls.speculative import SpeculationSettings, SpeculativeCall

    target, draft = Recorder(), Recorder()
    inputs = {
        "input_ids": np.array([[1, 2, 3]], np.int32),
        "input_lengths": np.array([[3]], np.int32),
        "request_output_len": np.array([[9]], np.int32),
        "guided_decoding_guide_type": strings("regex"),
        "guided_decoding_guide": strings("[0-9]+"),
    }
    call = SpeculativeCall(target, draft, inputs, SpeculationSettings(2, False), False, False, "r")
    (response,) = list(call.responses())
    assert response.outputs["output_ids"].reshape(-1).tolist() == list(range(7, 16))
    assert [int(c["guided_decoding_prefix_len"].item()) for c in target.calls] == [0, 3, 6]
    assert all(c["guided_decoding_guide_type"].tolist() == [["regex"]] for c in target.calls)
    assert all(c["guided_decoding_guide"].tolist() == [["[0-9]+"]] for c in target.calls)
    assert not any(name.startswith("guided_") for c in draft.calls for name in c), "the draft runs unguided"
    unguided = dict(inputs, guided_decoding_guide_type=strings(""), guided_decoding_guide=strings(""))
    target = Recorder()
    list(SpeculativeCall(target, Recorder(), unguided, SpeculationSettings(2, False), False, False, "r").responses())
    assert not any(name.startswith("guided_") for c in target.calls for name in c)


def test_guided_decoding_prefix_len_continues_the_rows_guide():
    request = llm_request(
        guided_decoding_guide_type=strings("regex"),
        guided_decoding_guide=strings("a+"),
        guided_decoding_prefix_len=np.array([[2]], np.int32),
    )
    (row,) = convert_request(request, False, True)
    assert row.params.guided_prefix_len == 2
    with pytest.raises(InputError, match="'guided_decoding_prefix_len' = 4 must be in \\[0, 3\\]"):
        convert_request(
            llm_request(guided_decoding_guide_type=strings("json"), guided_decoding_prefix_len=np.array([[4]])),
            False,
            True,
        )
    with pytest.raises(InputError, match="'guided_decoding_prefix_len' continues a guided output"):
        convert_request(llm_request(guided_decoding_prefix_len=np.array([[1]], np.int32)), False, True)


# ------------------------------------------------------------------------------------------------ repository builder


@pytest.fixture
def fake_model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    return model


def _backend_parameter(repo) -> str:
    text = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    (line,) = [line for line in text.splitlines() if '"guided_decoding_backend"' in line]
    return line.split("string_value:")[1].split('"')[1]


def test_the_builder_fills_xgrammar_unless_told_none(fake_model, tmp_path):
    assert _backend_parameter(build_repo(fake_model, tmp_path / "on")) == "xgrammar"
    assert _backend_parameter(build_repo(fake_model, tmp_path / "off", guided_decoding_backend=None)) == ""
    with pytest.raises(RepoError, match="guided_decoding_backend must be one of"):
        build_repo(fake_model, tmp_path / "bad", guided_decoding_backend="outlines")


def test_repo_build_takes_guided_decoding_backend_none(fake_model, tmp_path):
    from tritonllm.commands.main import main

    assert main(["repo", "build", "--model", str(fake_model), "--out", str(tmp_path / "r")]) == 0
    assert _backend_parameter(tmp_path / "r") == "xgrammar"
    argv = ["repo", "build", "--model", str(fake_model), "--out", str(tmp_path / "n"), "--guided-decoding-backend"]
    assert main([*argv, "none"]) == 0
    assert _backend_parameter(tmp_path / "n") == ""
