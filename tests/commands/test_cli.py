"""The `tritonllm` command: generate with a model.yaml, the bench scenarios' JSON, clear errors."""

import argparse
import json

import pytest
import yaml

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.main import build_parser, main

LONG_PROMPT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who mended his nets "
    "every morning and told the children stories about the storms he had seen."
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=2)


def json_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_generate_reports_reuse_and_prefill_steps_from_model_yaml(tiny, tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "dtype": "float32",
                "enable_chunked_prefill": True,
                "max_num_tokens": 8,
                "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": 4, "max_tokens": 1024},
            }
        )
    )
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny),
                "--config",
                str(config),
                "--prompt",
                LONG_PROMPT,
                "--prompt",
                LONG_PROMPT,
                "--max-tokens",
                "6",
                "--sequential",
                "--json",
            ]
        )
        == 0
    )
    first, second = json_lines(capsys)
    assert first["output_token_ids"] == second["output_token_ids"] and first["text"] == second["text"]
    prompt_len = len(first["prompt_token_ids"])
    assert first["stats"]["prefill_steps"] == -(-prompt_len // 8)  # 8-token chunks
    assert first["stats"]["kv_cache_reused_blocks"] == 0
    assert second["stats"]["kv_cache_reused_blocks"] == (prompt_len - 1) // 4
    assert second["stats"]["prefill_steps"] < first["stats"]["prefill_steps"]


def test_generate_without_reuse_or_chunking(tiny, tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"kv_cache_config": {"enable_block_reuse": False}}))
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny),
                "--config",
                str(config),
                "--prompt",
                LONG_PROMPT,
                "--prompt",
                LONG_PROMPT,
                "--max-tokens",
                "4",
                "--sequential",
                "--json",
            ]
        )
        == 0
    )
    records = json_lines(capsys)
    assert [r["stats"]["kv_cache_reused_blocks"] for r in records] == [0, 0]
    assert [r["stats"]["prefill_steps"] for r in records] == [1, 1]


@pytest.mark.parametrize(
    "argv, key",
    [
        # Streams long enough to outlast the long prompt (on the tiny model a step takes about a millisecond).
        (
            ["bench", "chunked", "--streams", "2", "--stream-tokens", "600", "--long-prompt", "200", "--chunk", "32"],
            "p99_itl_ratio_on_vs_off",
        ),
        (["bench", "reuse", "--requests", "4", "--system-prompt", "200"], "ttft_speedup_on_vs_off"),
    ],
)
def test_bench_scenarios_print_one_json_object(tiny, capsys, argv, key):
    assert main(argv + ["--model", str(tiny), "--json"]) == 0
    (result,) = json_lines(capsys)
    assert result[key] > 0 and result["off"] and result["on"]
    if "reuse" in argv:
        assert result["on"]["reused_blocks"] > 0 and result["off"]["reused_blocks"] == 0


def test_bad_values_are_one_clear_line(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "--prompt", "hi", "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny.parent), "--prompt", "hi"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_bench_engine_refuses_an_empty_length_range(tiny, capsys):
    assert main(["bench", "engine", "--model", str(tiny), "--max-output", "8"]) == 2  # --min-output is 16
    assert "--min-output 16 / --max-output 8: need min <= max" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, shown",
    [
        (["bench", "engine", "--requests", "0"], "0"),
        (["bench", "chunked", "--streams", "0"], "0"),
        (["bench", "reuse", "--system-prompt", "-5"], "-5"),
        (["bench", "spec", "--prompts", "0"], "0"),
        (["bench", "lora", "--requests", "x"], "'x'"),
        (["bench", "bls-spec", "--draft-model", "D", "--max-tokens", "0"], "0"),
    ],
)
def test_bench_counts_below_one_are_refused_before_anything_loads(argv, shown, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--model", "no-such-folder"])
    assert exit_info.value.code == 2
    assert f"argument {argv[-2]}: must be an integer >= 1, got {shown}" in capsys.readouterr().err


def _options_without_help(parser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                missing += _options_without_help(subparser, f"{path} {name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append(f"{path} {'/'.join(action.option_strings)}")
    return missing


def test_every_option_has_help():
    missing = _options_without_help(build_parser(), "tritonllm")
    assert not missing, "options without help text:\n" + "\n".join(missing)
