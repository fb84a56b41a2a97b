"""`tritonllm quantize` end to end on tiny models: a checkpoint the engine loads and runs, progress on stderr, and
bad input (an unknown --algo, a group size that does not divide, a mixture-of-experts model, a missing
calibration file, a calibration text shorter than --seq-len) refused with a message naming it."""

import json

import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.commands.main import main
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.quant.linear import QuantLinear

FAST = ["--samples", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def quantize(capsys, *argv) -> tuple[int, str, str]:
    code = main(["quantize", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_writes_a_checkpoint_the_engine_runs(tiny, tmp_path, capsys):
    out = tmp_path / "w4"
    code, stdout, err = quantize(
        capsys, "--model", str(tiny), "--out", str(out), "--algo", "W4A16_ASYM", "--group-size", "32", *FAST, "--json"
    )
    assert code == 0, err
    result = json.loads(stdout)
    assert (result["algo"], result["layers"], result["modules"]) == ("W4A16_ASYM", 2, 14)
    assert "[quantize] layer 1/2: 7 projections" in err and "[quantize] layer 2/2" in err
    model, _ = load_model(out, torch.float32, "cpu")
    modules = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert modules and all(m.kind == "int4" and m.group_size == 32 for m in modules)
    assert main(["generate", "--model", str(out), "--device", "cpu", "--prompt", "hello", "--max-tokens", "4"]) == 0


def test_excluded_modules_stay_dense_and_are_ignored_by_name(tiny, tmp_path, capsys):
    out = tmp_path / "fp8"
    code, _, err = quantize(
        capsys, "--model", str(tiny), "--out", str(out), "--algo", "FP8", "--exclude-modules", "*.down_proj", *FAST
    )
    assert code == 0, err
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    model, _ = load_model(out, torch.float32, "cpu")
    assert not isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--algo", "W3A16"], "--algo 'W3A16' is not supported; choose one of W4A16, W4A16_ASYM, FP8"),
        (
            ["--algo", "W4A16", "--group-size", "48"],
            "--group-size 48 does not divide model.layers.0.self_attn.q_proj's 64 input columns",
        ),
        (["--algo", "W4A16", "--calibration", "absent.txt"], "--calibration absent.txt: no such file"),
        (["--algo", "FP8", "--seq-len", "100000"], "--seq-len 100000: the shipped calibration text has only"),
    ],
)
def test_bad_input_is_an_error_naming_it(tiny, tmp_path, capsys, extra, message):
    code, _, err = quantize(capsys, "--model", str(tiny), "--out", str(tmp_path / "out"), *extra)
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()


def test_a_mixture_of_experts_model_is_refused_by_name(tmp_path, capsys):
    moe = build_tiny_model(tmp_path / "moe", arch="mixtral")
    code, _, err = quantize(capsys, "--model", str(moe), "--out", str(tmp_path / "out"), "--algo", "W4A16")
    assert code == 2 and "a mixture-of-experts model (mixtral" in err and "dense decoder models only" in err


def test_an_already_quantized_checkpoint_or_an_occupied_out_is_refused(tiny, tmp_path, capsys):
    out = tmp_path / "once"
    assert quantize(capsys, "--model", str(tiny), "--out", str(out), "--algo", "FP8", *FAST)[0] == 0
    code, _, err = quantize(capsys, "--model", str(out), "--out", str(tmp_path / "twice"), "--algo", "FP8")
    assert code == 2 and "already quantized (compressed-tensors)" in err
    code, _, err = quantize(capsys, "--model", str(tiny), "--out", str(out), "--algo", "FP8")
    assert code == 2 and f"--out {out} already holds a checkpoint" in err
    code, _, err = quantize(capsys, "--model", str(tiny), "--out", str(tiny), "--algo", "FP8")
    assert code == 2 and "is the --model folder" in err
