"""`tritonllm bench accuracy` on the tiny random Llama (CPU): the report end to end, the baseline against itself
(ratio 1, ROUGE 1), its perplexity against Hugging Face transformers on the same weights and windows, and the
errors of a bad --config."""

import contextlib
import io
import json
import math

import pytest
import torch

from tritonllm.bench.texts import load_passages, windows
from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.main import main

pytest.importorskip("rouge_score")

SHORT = ["--device", "cpu", "--dtype", "float32", "--prompts", "3", "--max-tokens", "8", "--window", "512"]
SIDE_KEYS = {
    "model",
    "dtype",
    "device",
    "load_format",
    "max_seq_len",
    "perplexity",
    "scored_tokens",
    "windows",
    "perplexity_by_passage",
    "continuation_tokens",
    "seconds",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _json_line(out: str) -> dict:
    (line,) = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(line)


def _run(capsys, argv) -> tuple[dict, str]:
    assert main(["bench", "accuracy", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    return _json_line(captured.out), captured.err


@pytest.fixture(scope="module")
def itself(tiny):
    """The baseline against itself (no --config), run once for the tests that read it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["bench", "accuracy", "--model", str(tiny), *SHORT, "--json"]) == 0
    return _json_line(out.getvalue())


def test_the_baseline_against_itself_scores_ratio_one_and_rouge_one(itself):
    assert set(itself["baseline"]) == SIDE_KEYS and itself["baseline"]["dtype"] == "float32"
    assert itself["perplexity_ratio"] == 1.0
    assert (itself["rouge1"], itself["rouge2"], itself["rougeL"], itself["token_agreement"]) == (1.0, 1.0, 1.0, 1.0)
    assert itself["identical_continuations"] == itself["prompts"] == 3
    assert itself["agreeing_tokens"] == itself["compared_tokens"] == itself["baseline"]["continuation_tokens"] > 0
    assert itself["config"] is None and itself["warnings"] == [] and itself["window"] == 512
    # Random weights: a large perplexity, but a finite one.
    assert math.isfinite(itself["baseline"]["perplexity"]) and itself["baseline"]["perplexity"] > 1


def test_the_perplexity_is_hugging_faces_on_the_same_weights_and_windows(tiny, itself):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    for name, text in load_passages().items():
        passage_total, passage_tokens = 0.0, 0
        for ids in windows(tokenizer.encode(text), itself["window"]):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].double()
            targets = torch.tensor(ids[1:])
            passage_total += float(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum"))
            passage_tokens += len(ids) - 1
        mean_nll = passage_total / passage_tokens
        assert math.log(itself["baseline"]["perplexity_by_passage"][name]) == pytest.approx(mean_nll, abs=1e-4)
        total, tokens = total + passage_total, tokens + passage_tokens
    assert itself["baseline"]["scored_tokens"] == tokens
    assert math.log(itself["baseline"]["perplexity"]) == pytest.approx(total / tokens, abs=1e-4)


def test_a_config_override_reports_both_sides_their_ratio_and_warns_of_dummy_weights(tiny, tmp_path, capsys):
    config = tmp_path / "bf16.yaml"
    config.write_text("dtype: bfloat16\n")
    result, err = _run(capsys, ["--model", str(tiny), *SHORT, "--config", str(config), "--load-format", "dummy"])
    base, cand = result["baseline"], result["candidate"]
    assert (base["dtype"], cand["dtype"], base["load_format"], result["config"]) == (
        "float32",
        "bfloat16",
        "dummy",
        str(config),
    )
    assert "load_format dummy" in result["warnings"][0] and "warning: load_format dummy" in err
    assert "[bench] candidate: engine ready" in err
    assert result["perplexity_ratio"] == pytest.approx(cand["perplexity"] / base["perplexity"], rel=1e-5)
    assert base["scored_tokens"] == cand["scored_tokens"] and base["windows"] == cand["windows"]
    for name in ("rouge1", "rouge2", "rougeL", "token_agreement"):
        assert 0.0 <= result[name] <= 1.0
    assert result["compared_tokens"] >= max(base["continuation_tokens"], cand["continuation_tokens"]) // 3
    assert result["prompts"] == 3 and result["seconds"] > 0


def test_a_missing_config_file_is_an_error_naming_it(tiny, tmp_path, capsys):
    missing = tmp_path / "absent.yaml"
    assert main(["bench", "accuracy", "--model", str(tiny), "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--config {missing}: cannot read engine config" in err


def test_an_unknown_config_key_is_an_error_naming_it_before_anything_loads(tiny, tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text("dtpye: bfloat16\n")
    assert main(["bench", "accuracy", "--model", str(tiny), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"--config {config}: the candidate: the embedded engine cannot honour: dtpye='bfloat16'" in err
    assert "[bench]" not in err  # refused before the tokenizer or any engine


def test_a_missing_rouge_score_is_an_error_saying_how_to_install_it(tiny, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "rouge_score.rouge_scorer", None)  # import fails as if not installed
    assert main(["bench", "accuracy", "--model", str(tiny)]) == 2
    err = capsys.readouterr().err
    assert "the accuracy bench needs rouge-score" in err and "pip install 'rouge-score==0.1.2'" in err
    assert "[bench]" not in err


def test_a_candidate_model_is_another_checkpoint_with_the_same_flags(tiny, tmp_path, capsys):
    other = build_tiny_model(tmp_path / "other", seed=1)
    result, err = _run(capsys, ["--model", str(tiny), *SHORT, "--candidate-model", str(other)])
    base, cand = result["baseline"], result["candidate"]
    assert (base["model"], cand["model"], result["candidate_model"]) == (str(tiny), str(other), str(other))
    assert (base["dtype"], cand["dtype"]) == ("float32", "float32")
    assert base["scored_tokens"] == cand["scored_tokens"] and result["perplexity_ratio"] != 1.0


def test_a_missing_candidate_model_is_an_error_naming_it(tiny, tmp_path, capsys):
    missing = tmp_path / "absent"
    assert main(["bench", "accuracy", "--model", str(tiny), "--candidate-model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--candidate-model {missing}:" in err and "[bench]" not in err
