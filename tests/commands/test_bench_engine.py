"""`tritonllm bench engine`: its workloads (nano-vllm's request mix), the checks on its flags, the engine settings
each workload implies, and short runs on a weightless tiny model with dummy weights."""

import gc
import json

import pytest
import yaml
from tokenizers import Tokenizer

from tritonllm.checkpoints.shapes import write_shape_folder
from tritonllm.checkpoints.tiny import tiny_config, trained_tokenizer_json
from tritonllm.commands.bench_engine import collector_pauses, engine_config, make_nano_requests, resolve_workload
from tritonllm.commands.bench_profile import busy_share, top_kernels
from tritonllm.commands.main import build_parser, main

JSON_KEYS = {
    "requests",
    "output_tokens",
    "dtype",
    "device",
    "threads",
    "engine_s",
    "engine_tok_s",
    "workload",
    "load_format",
    "warmup",
    "baseline",
    "peak_memory_bytes",
    "engine_steps",
    "engine_phase_s",
    "engine_token_wait_s",
    "gc_pause_s",
    "gc_collections",
    "attn_backend",
    "max_batch_size",
    "cuda_graphs",
}
HF_KEYS = {"hf_s", "hf_tok_s", "ratio", "hf_batch_size"}
SHORT_MIX = ["--requests", "3", "--min-prompt", "4", "--max-prompt", "24", "--min-output", "2", "--max-output", "6"]


@pytest.fixture(scope="module")
def weightless(tmp_path_factory):
    vocab = Tokenizer.from_str(trained_tokenizer_json()).get_vocab_size()
    return write_shape_folder(tiny_config("llama", vocab), tmp_path_factory.mktemp("weightless"))


def bench_args(*argv):
    return build_parser().parse_args(["bench", "engine", "--model", "m", *argv])


def json_result(capsys) -> dict:
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return json.loads(line)


# ---- workloads and flags ----


def test_nano_requests_are_nano_vllms_mix_and_repeat_for_a_seed():
    requests = make_nano_requests(vocab_size=151936, seed=0)
    assert len(requests) == 256
    assert all(100 <= len(r.prompt_ids) <= 1024 and 100 <= r.output_len <= 1024 for r in requests)
    assert max(max(r.prompt_ids) for r in requests) < 10000
    assert make_nano_requests(151936, seed=0) == requests
    assert make_nano_requests(151936, seed=1) != requests
    small_vocab = make_nano_requests(vocab_size=500, seed=0)
    assert max(max(r.prompt_ids) for r in small_vocab) < 500


def test_nano_workload_sets_the_batch_and_length_unless_told_otherwise(tmp_path):
    nano = resolve_workload(bench_args("--workload", "nano"))
    assert (nano.requests, nano.prompt_range, nano.output_range) == (256, (100, 1024), (100, 1024))
    config = engine_config(bench_args("--workload", "nano"), nano)
    assert (config.max_batch_size, config.max_seq_len) == (256, 4096)
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text(yaml.safe_dump({"max_seq_len": 2048, "max_batch_size": 32, "attn_backend": "vanilla"}))
    config = engine_config(bench_args("--workload", "nano", "--config", str(yaml_file)), nano)
    assert (config.max_batch_size, config.max_seq_len, config.attn_backend) == (32, 2048, "VANILLA")
    config = engine_config(bench_args("--workload", "nano", "--config", str(yaml_file), "--max-batch-size", "8"), nano)
    assert config.max_batch_size == 8
    default = resolve_workload(bench_args())
    assert (default.requests, default.prompt_range, default.output_range) == (16, (16, 256), (16, 128))
    assert engine_config(bench_args(), default).max_batch_size == 64  # the engine's own default


def test_load_format_comes_from_the_flag_else_the_config(tmp_path):
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text(yaml.safe_dump({"load_format": "DUMMY"}))
    workload = resolve_workload(bench_args())
    assert engine_config(bench_args(), workload).load_format == "auto"
    assert engine_config(bench_args("--config", str(yaml_file)), workload).load_format == "dummy"
    assert (
        engine_config(bench_args("--config", str(yaml_file), "--load-format", "auto"), workload).load_format == "auto"
    )


def test_nano_workload_refuses_request_mix_flags_before_anything_loads(capsys):
    assert (
        main(
            [
                "bench",
                "engine",
                "--model",
                "no-such-folder",
                "--workload",
                "nano",
                "--requests",
                "8",
                "--max-output",
                "64",
            ]
        )
        == 2
    )
    assert "--workload nano fixes the request mix" in capsys.readouterr().err.replace("\n", " ")


def test_collector_pauses_count_collections():
    with collector_pauses() as pauses:
        gc.collect()
    assert pauses["collections"] >= 1 and pauses["seconds"] > 0


def test_profile_arithmetic():
    # Overlapping and nested kernels count once: [0, 4) and [6, 8) of a 10 us wall.
    assert busy_share([(0, 3), (1, 4), (2, 2.5), (6, 8)], 10.0) == pytest.approx(0.6)
    assert busy_share([], 10.0) == 0.0
    top = top_kernels([("gemm", 30.0), ("norm", 5.0), ("gemm", 10.0)], limit=1)
    assert top == [{"name": "gemm", "calls": 2, "total_ms": 0.04, "mean_us": 20.0}]


# ---- runs ----


def test_engine_alone_with_dummy_weights_warmup_and_profile(weightless, tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"attn_backend": "VANILLA", "kv_cache_config": {"max_tokens": 2048}}))
    trace = tmp_path / "trace.json"
    assert (
        main(
            [
                "bench",
                "engine",
                "--model",
                str(weightless),
                "--config",
                str(config),
                "--baseline",
                "none",
                "--warmup",
                "--load-format",
                "dummy",
                "--profile-trace",
                str(trace),
                "--json",
                *SHORT_MIX,
            ]
        )
        == 0
    )
    result = json_result(capsys)
    assert JSON_KEYS <= set(result) and not HF_KEYS & set(result)
    assert (result["workload"], result["load_format"], result["baseline"], result["warmup"]) == (
        "default",
        "dummy",
        "none",
        True,
    )
    assert result["attn_backend"] == "VANILLA" and result["cuda_graphs"] is False
    assert result["requests"] == 3 and result["engine_steps"] > 0 and result["peak_memory_bytes"] > 0
    phases = result["engine_phase_s"]
    assert set(phases) == {"prefill", "decode"} and min(phases.values()) > 0
    assert sum(phases.values()) <= result["engine_s"] + 1e-3
    assert 0 <= result["engine_token_wait_s"] <= sum(phases.values())
    assert "gpu_busy_share" not in result  # CPU
    assert result["profile_top_kernels"] and {"name", "calls", "total_ms", "mean_us"} == set(
        result["profile_top_kernels"][0]
    )
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"step prefill", "step decode"} <= names  # the engine's step ranges, which bench_phases.py splits by
    assert result["profile_phases"]["phases"] == {}  # a CPU trace has no GPU events to split


def test_dummy_weights_against_hugging_face_from_config(weightless, capsys):
    assert (
        main(
            [
                "bench",
                "engine",
                "--model",
                str(weightless),
                "--load-format",
                "dummy",
                "--hf-batch-size",
                "2",
                "--json",
                *SHORT_MIX,
            ]
        )
        == 0
    )
    result = json_result(capsys)
    assert JSON_KEYS | HF_KEYS <= set(result)
    assert result["warmup"] is False and result["baseline"] == "hf" and result["ratio"] > 0


@pytest.mark.parametrize("sizes", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]])
def test_a_parallel_engine_starts_its_other_ranks_and_stops_them(weightless, capsys, sizes):
    """Two ranks on CPU (gloo): the bench is rank 0, a `tritonllm follow --engine-args` process rank 1; the run
    completes every request and the follower stops with the engine."""
    import os

    from tritonllm.engine.embedded.parallel.environment import read_rank_environment

    argv = ["bench", "engine", "--model", str(weightless), "--device", "cpu", "--dtype", "float32"]
    argv += ["--load-format", "dummy", "--baseline", "none", "--json", *SHORT_MIX, *sizes]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    (result,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert (result["tensor_parallel_size"], result["pipeline_parallel_size"]) == (
        (2, 1) if "--tensor-parallel-size" in sizes else (1, 2)
    )
    assert result["engine_steps"] > 0 and result["output_tokens"] > 0
    assert read_rank_environment(os.environ) is None  # rank 0's variables are gone with the bench
    log_dir = err.split("the others log to ")[1].split()[0]
    assert "rank 1 stops after" in open(os.path.join(log_dir, "follower-1.log")).read()
