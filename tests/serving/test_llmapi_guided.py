"""Guided decoding in the LLM-API model: `guided_decoding_guide_type` / `guided_decoding_guide` into the engine's
GuidedDecodingParams (every refusal names the input), `guided_decoding_backend` from model.yaml's top level, and a
loaded model (fake pb_utils, real embedded engine on the tiny random Llama, which writes no JSON by chance) whose
answers follow the schema or the regex, streamed or not."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import fake_pb_utils as fake  # registered by conftest.py
import numpy as np
import pytest
import yaml

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.bench_guided import schema_errors
from tritonllm.deploy.llmapi_repo import build_llmapi_repo
from tritonllm.engine.config import ConfigError
from tritonllm.engine.types import GuidedDecodingParams
from tritonllm.triton.llmapi_config import load_llmapi_settings
from tritonllm.triton.llmapi_guided import guided_decoding
from tritonllm.triton.pb import InputError

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    },
    "required": ["name", "kind", "tags"],
}
REGEX = r"(yes|no), [a-z]{2,4}!"


def strings(*values: str) -> np.ndarray:
    return np.array([value.encode() for value in values], dtype=object)


def guide_request(guide_type=None, guide=None, **extra) -> fake.InferenceRequest:
    tensors = {"text_input": strings("The lamp turned"), **extra}
    if guide_type is not None:
        tensors["guided_decoding_guide_type"] = strings(guide_type)
    if guide is not None:
        tensors["guided_decoding_guide"] = strings(guide)
    return fake.InferenceRequest(tensors)


@pytest.fixture
def pb_utils(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)


# ---- the inputs ----


def test_each_guide_type_becomes_its_guided_decoding_field(pb_utils):
    assert guided_decoding(guide_request()) is None
    assert guided_decoding(guide_request("json")) == GuidedDecodingParams(json_object=True)
    assert guided_decoding(guide_request("json_schema", json.dumps(SCHEMA))).json == json.dumps(SCHEMA)
    assert guided_decoding(guide_request("regex", REGEX)).regex == REGEX
    assert guided_decoding(guide_request("ebnf_grammar", 'root ::= "a"')).grammar == 'root ::= "a"'
    assert guided_decoding(guide_request("", "")) is None  # empty strings count as absent


@pytest.mark.parametrize(
    "guide_type, guide, message",
    [
        ("xml", "<a/>", "input 'guided_decoding_guide_type': guided_decoding_guide_type must be one of"),
        ("regex", None, "input 'guided_decoding_guide': guided_decoding_guide_type='regex' needs a guided_decoding"),
        ("json_schema", "{not json", "input 'guided_decoding_guide': guided_decoding.json"),
        (None, "[a-z]+", "input 'guided_decoding_guide' needs guided_decoding_guide_type"),
    ],
)
def test_bad_guides_are_refused_naming_the_input(pb_utils, guide_type, guide, message):
    with pytest.raises(InputError) as caught:
        guided_decoding(guide_request(guide_type, guide))
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_guide_of_several_strings_is_refused(pb_utils):
    request = fake.InferenceRequest({"guided_decoding_guide_type": strings("regex", "json")})
    with pytest.raises(InputError, match="'guided_decoding_guide_type' must hold one string, got shape \\[2\\]"):
        guided_decoding(request)


# ---- model.yaml ----


def test_guided_decoding_backend_is_a_top_level_llm_argument_of_model_yaml(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    repo = build_llmapi_repo(model, tmp_path / "repo", engine_args={"guided_decoding_backend": "xgrammar"})
    version = repo / "tensorrt_llm" / "1"
    assert yaml.safe_load((version / "model.yaml").read_text())["guided_decoding_backend"] == "xgrammar"
    assert load_llmapi_settings(version).engine.guided_decoding_backend == "xgrammar"
    (version / "model.yaml").write_text((version / "model.yaml").read_text().replace("xgrammar", "outlines"))
    with pytest.raises(ConfigError, match="guided_decoding_backend must be one of"):
        load_llmapi_settings(version)


# ---- the loaded model ----


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def guided_model(model_dir, tmp_path_factory, load_llmapi_model):
    engine_args = {"guided_decoding_backend": "xgrammar"}
    repo = build_llmapi_repo(model_dir, tmp_path_factory.mktemp("guided"), max_seq_len=512, engine_args=engine_args)
    with load_llmapi_model(repo) as instance:
        yield instance


def run(model, req, timeout: float = 120) -> list:
    model.execute([req])
    sender = req.get_response_sender()
    deadline = time.monotonic() + timeout
    while not sender.finished:
        assert time.monotonic() < deadline, f"no final response within {timeout}s"
        time.sleep(0.005)
    return sender.sent


def texts(sent) -> list[str]:
    for response, _ in sent:
        assert not response.has_error(), response.error().message()
    return [response.output_tensors()[0].as_numpy()[0].decode() for response, _ in sent]


ANSWER = dict(
    sampling_param_max_tokens=np.array([400], dtype=np.int32),
    sampling_param_exclude_input_from_output=np.array([True]),
)


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streamed"])
def test_a_json_schema_request_answers_json_that_validates(guided_model, streaming):
    request = guide_request("json_schema", json.dumps(SCHEMA), streaming=np.array([streaming]), **ANSWER)
    answers = texts(run(guided_model, request))
    assert len(answers) > 1 if streaming else len(answers) == 1
    assert schema_errors(SCHEMA, json.loads(answers[-1])) == []


def test_a_regex_request_answers_text_that_fully_matches(guided_model):
    (answer,) = texts(run(guided_model, guide_request("regex", REGEX, **ANSWER)))
    assert re.fullmatch(REGEX, answer), answer


def test_an_unguided_request_to_the_same_model_is_not_constrained(guided_model):
    short = {**ANSWER, "sampling_param_max_tokens": np.array([8], dtype=np.int32)}
    (answer,) = texts(run(guided_model, guide_request(**short)))
    assert not re.fullmatch(REGEX, answer)


def test_a_guide_that_does_not_compile_is_refused_naming_the_guided_inputs(guided_model):
    ((response, flags),) = run(guided_model, guide_request("ebnf_grammar", "root ::= undefined_rule"))
    assert flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    message = response.error().message()
    assert message.startswith("inputs 'guided_decoding_guide_type', 'guided_decoding_guide': ")
    assert "does not compile" in message
