"""`repo build` and `repo fill` parse every config.pbtxt they write as Triton does (protobuf text format into
tritonclient's ModelConfig): an unfilled structural placeholder or a value of the wrong type is refused, naming
the file, the line and the parameter to set. Where the backend's own fill_template.py gives a loadable file,
`repo fill` gives the same bytes."""

from __future__ import annotations

import shutil
from pathlib import Path
from string import Template

import pytest

from tritonllm.deploy.pbtxt_check import config_errors, value_spans
from tritonllm.deploy.repo import RepoError, build_repo, fill_template, template_dir, validate_repo

pytest.importorskip("tritonclient.grpc.model_config_pb2")

# The backend's CI fills its templates with these command lines (ci/L0_backend_trtllm/test.sh, python backend).
CI_FILLS = {
    "ensemble": "triton_max_batch_size:64,logits_datatype:TYPE_FP32",
    "preprocessing": "tokenizer_dir:{model},triton_max_batch_size:64,preprocessing_instance_count:1",
    "tensorrt_llm": "triton_backend:python,triton_max_batch_size:64,decoupled_mode:true,engine_dir:{model},"
    "max_queue_delay_microseconds:0,batching_strategy:inflight_batching,max_queue_size:0,"
    "max_tokens_in_paged_kv_cache:2560,max_attention_window_size:2560,kv_cache_free_gpu_mem_fraction:0.5,"
    "request_stats_max_iterations:10,exclude_input_in_output:True,enable_kv_cache_reuse:True,"
    "encoder_input_features_data_type:TYPE_FP16,logits_datatype:TYPE_FP32",
    "postprocessing": "tokenizer_dir:{model},triton_max_batch_size:64,postprocessing_instance_count:1",
    "tensorrt_llm_bls": "triton_max_batch_size:64,decoupled_mode:true,bls_instance_count:1,logits_datatype:TYPE_FP32",
}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    return model


@pytest.fixture
def template_copy(tmp_path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(template_dir(), repo, ignore=shutil.ignore_patterns("llmapi"))
    return repo


def fill_template_py(text: str, substitutions: str) -> str:
    """What the backend's tools/fill_template.py writes, from its documented behaviour: queue settings pre-filled
    with 0, the pairs split at ',' and ':' (a backslash escapes), string.Template.safe_substitute."""
    values: dict[str, object] = {"max_queue_size": 0, "max_queue_delay_microseconds": 0}
    for pair in substitutions.split(","):
        key, value = pair.split(":", 1)
        values[key] = value
    return Template(text).safe_substitute(values)


# ---------------------------------------------------------------------------------------------- repo fill


def test_the_backends_ci_fills_give_fill_template_py_bytes_and_a_loadable_repo(template_copy, model_dir):
    for name, pairs in CI_FILLS.items():
        config = template_copy / name / "config.pbtxt"
        original = config.read_text()
        fill_template(config, pairs.format(model=model_dir))
        expected = fill_template_py(original, pairs.format(model=model_dir))
        if name == "tensorrt_llm_bls":
            # The one difference: the prompt table's data_type, which fill_template.py leaves as a placeholder
            # Triton cannot parse, takes the anchor's fixed TYPE_FP16.
            assert "data_type: ${prompt_embedding_table_data_type}" in expected
            expected = expected.replace("${prompt_embedding_table_data_type}", "TYPE_FP16")
        assert config.read_text() == expected, name
    assert validate_repo(template_copy) == []


def test_a_value_of_the_wrong_type_is_refused_naming_the_line_and_parameter(template_copy, model_dir):
    config = template_copy / "tensorrt_llm" / "config.pbtxt"
    before = config.read_text()
    good = CI_FILLS["tensorrt_llm"].format(model=model_dir)
    line = next(n for n, text in enumerate(before.splitlines(), 1) if "${decoupled_mode}" in text)
    with pytest.raises(RepoError) as error:
        fill_template(config, good.replace("decoupled_mode:true", "decoupled_mode:maybe"))
    message = str(error.value)
    assert f"{config}:{line}: decoupled_mode was filled with 'maybe'" in message
    assert 'Expected "true" or "false"' in message and "nothing written" in message
    assert config.read_text() == before
    with pytest.raises(RepoError, match=r"logits_datatype was filled with 'FP32'.*no value named FP32"):
        fill_template(config, good.replace("logits_datatype:TYPE_FP32", "logits_datatype:FP32"))
    with pytest.raises(RepoError, match=r"triton_max_batch_size was filled with 'lots'.*parse integer"):
        fill_template(config, good.replace("triton_max_batch_size:64", "triton_max_batch_size:lots"))


def test_an_unfilled_structural_placeholder_is_refused_unless_unchecked(template_copy):
    config = template_copy / "postprocessing" / "config.pbtxt"
    before = config.read_text()
    line = next(n for n, text in enumerate(before.splitlines(), 1) if "${postprocessing_instance_count}" in text)
    with pytest.raises(RepoError) as error:
        fill_template(config, "tokenizer_dir:/m,triton_max_batch_size:8")
    assert f"{config}:{line}: count holds the unfilled placeholder ${{postprocessing_instance_count}}" in str(
        error.value
    )
    assert config.read_text() == before
    fill_template(config, "tokenizer_dir:/m,triton_max_batch_size:8", check=False)  # a fill in two steps
    fill_template(config, "postprocessing_instance_count:2")
    assert "count: 2" in config.read_text()


def test_repo_fill_command_refuses_and_accepts_fill_template_py_flags(template_copy, capsys):
    from tritonllm.commands.main import main

    config = template_copy / "ensemble" / "config.pbtxt"
    assert main(["repo", "fill", str(config), "triton_max_batch_size:8"]) == 2
    assert "${logits_datatype}" in capsys.readouterr().err
    assert main(["repo", "fill", "-i", str(config), "triton_max_batch_size:8,logits_datatype:TYPE_FP32"]) == 0
    assert validate_repo(template_copy) != []  # the other models are still unfilled
    assert "${" not in config.read_text().split("parameters", 1)[0]


# ---------------------------------------------------------------------------------------------- repo build


def test_build_refuses_a_param_triton_cannot_parse(model_dir, tmp_path):
    with pytest.raises(RepoError) as error:
        build_repo(model_dir, tmp_path / "out", parameters={"logits_datatype": "float32"})
    message = str(error.value)
    assert f"{tmp_path / 'out' / 'tensorrt_llm' / 'config.pbtxt'}:" in message
    assert "logits_datatype was filled with 'float32'" in message and "no value named float32" in message
    assert not (tmp_path / "out" / "tensorrt_llm").exists()


def test_validate_repo_traces_a_hand_edited_value_to_its_placeholder(model_dir, tmp_path):
    repo = build_repo(model_dir, tmp_path / "repo")
    config = repo / "preprocessing" / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1", "count: one", 1))
    errors = validate_repo(repo)
    assert len(errors) == 1
    assert "preprocessing_instance_count was filled with 'one'" in errors[0] and str(config) in errors[0]


# ---------------------------------------------------------------------------------------------- the checker


def test_an_empty_value_is_named_on_its_own_line_though_the_parser_stops_on_the_next():
    template = 'name: "m"\nmax_batch_size: ${size}\nmodel_transaction_policy { decoupled: ${mode} }\n'
    filled = Template(template).substitute(size="", mode="true")
    (error,) = config_errors(filled, "m/config.pbtxt", template)
    assert error.startswith("m/config.pbtxt:2: size was filled with ''")


def test_without_the_template_the_line_and_the_parsers_reason_are_given():
    (error,) = config_errors('name: "m"\nmax_batch_size: x\n', "f.pbtxt")
    assert error == "f.pbtxt:2: Triton cannot parse 'max_batch_size: x': Couldn't parse integer: x"
    assert config_errors('name: "m"\nparameters { key: "a" value { string_value: "${unset}" } }\n', "f") == []


@pytest.mark.parametrize(
    "source, filled, spans",
    [
        ("a: ${x}", "a: 12", [(3, 5, "x")]),
        ("p { q: [ ${x} ] r: ${y} }", "p { q: [ 4 ] r: 100 }", [(9, 10, "x"), (16, 19, "y")]),
        ("a: ${x}${y}", "a: 12", []),  # side by side: which value is which is unknowable
        ("a: ${x} b", "c: 1 b", []),  # not the line the template became
    ],
)
def test_value_spans(source, filled, spans):
    assert value_spans(source, filled) == spans
