"""`tritonllm bench guided`: its schema check, its prompts, and one short run end to end on the tiny random Llama
(the report's fields and their consistency; no timing assertions)."""

import json

import pytest

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.bench_guided import SCHEMA, bench_prompts, conforms, schema_errors
from tritonllm.commands.main import main

pytest.importorskip("xgrammar")

PERSON = {"name": "Ada", "age": 36, "role": "engineer", "skills": ["math", "looms"], "active": True}


def test_the_schema_check_accepts_a_conforming_object_and_names_each_break():
    assert schema_errors(SCHEMA, PERSON) == []
    broken = {**PERSON, "age": 130, "role": "pilot", "skills": [], "active": "yes", "extra": 1}
    del broken["name"]
    assert schema_errors(SCHEMA, broken) == [
        "$: missing 'name'",
        "$: unexpected 'extra'",
        "$.age: 130 > maximum 120",
        "$.role: 'pilot' is not one of ['engineer', 'doctor', 'teacher', 'artist', 'farmer']",
        "$.skills: 0 items < minItems 1",
        "$.active: expected boolean, got str",
    ]
    assert schema_errors(SCHEMA, {**PERSON, "age": True}) == ["$.age: expected integer, got bool"]
    assert schema_errors(SCHEMA, {**PERSON, "name": ""}) == ["$.name: length 0 < minLength 1"]
    assert conforms(json.dumps(PERSON)) and not conforms(json.dumps(PERSON)[:-1]) and not conforms("[]")


def test_prompts_differ_even_past_the_shipped_descriptions():
    prompts = bench_prompts(10)
    assert len(set(prompts)) == 10 and all("JSON object" in prompt for prompt in prompts)


def test_a_short_run_reports_both_sides_the_ratio_validity_and_compile_times(tmp_path, capsys):
    model = build_tiny_model(tmp_path / "tiny")
    argv = ["bench", "guided", "--model", str(model), "--device", "cpu", "--dtype", "float32"]
    assert main([*argv, "--requests", "2", "--rounds", "2", "--max-tokens", "12", "--json"]) == 0
    captured = capsys.readouterr()
    (line,) = [line for line in captured.out.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert "[bench] round 2/2 (guided first, unguided second)" in captured.err
    assert (result["requests"], result["rounds"], result["max_tokens"]) == (2, 2, 12)
    for side in ("unguided", "guided"):
        assert set(result[side]) == {
            "output_tokens",
            "decode_tokens",
            "ms_per_token",
            "wall_s",
            "wall_ms_per_token",
            "mean_ttft_ms",
        }
        assert 0 < result[side]["output_tokens"] <= 2 * 2 * 12
    # The unguided requests run to the guided answers' lengths of the warm-up: the same counts when those repeat.
    if result["same_lengths_as_warmup"]:
        assert result["unguided"]["output_tokens"] == result["guided"]["output_tokens"]
    assert result["ratio"] == round(result["guided"]["ms_per_token"] / result["unguided"]["ms_per_token"], 3)
    assert len(result["round_ratios"]) == 2 and result["guided_outputs"] == 4
    assert result["median_round_ratio"] == pytest.approx(sum(result["round_ratios"]) / 2)  # two rounds
    assert 0 <= result["valid_outputs"] <= 4 and result["valid_fraction"] == round(result["valid_outputs"] / 4, 3)
    assert result["compile"]["first_request_ms"] > 0 and result["compile"]["cached_request_ms"] > 0
    assert result["grammars_compiled"] == 1 and result["schema"] == SCHEMA and result["device"] == "cpu"
    cost = result["grammar_step_cost"]
    assert cost["steps"] >= 1 and cost["mask_ms_per_step"] > 0 and cost["advance_ms_per_step"] > 0
    assert cost["rejected_tokens"] == 0
    assert result["grammar_ratio"] > 1
