"""`tritonllm launch`: launch_triton_server.py's flags, the tritonserver it picks, the command line it gives it,
and what it refuses before starting anything (a real start is in tests/e2e/test_launch.py)."""

from __future__ import annotations

import argparse
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from tritonllm.commands.launch import options_from
from tritonllm.commands.main import build_parser
from tritonllm.deploy import launch as launch_module
from tritonllm.deploy.launch import (
    Binary,
    LaunchError,
    LaunchOptions,
    busy_ports,
    check_no_other_server,
    check_options,
    find_tritonserver,
    needs_auto_complete,
    notes,
    running_tritonservers,
    server_command,
)

# Every flag of the backend's scripts/launch_triton_server.py (at the anchor commit), with a value where it takes one.
SCRIPT_FLAGS = [
    "--world_size=1",
    "--tritonserver=/opt/tritonserver/bin/tritonserver",
    "--grpc_port=9001",
    "--http_port=9000",
    "--metrics_port=9002",
    "--force",
    "--log",
    "--log-file=my_log.txt",
    "--no-mpi",
    "--model_repo=/models/repo",
    "--tensorrt_llm_model_name=tensorrt_llm,tensorrt_llm_draft",
    "--multi-model",
    "--disable-spawn-processes",
    "--multimodal_gpu0_cuda_mem_pool_bytes=300000000",
    "--oversubscribe",
]


def launch_args(*argv: str):
    return build_parser().parse_args(["launch", *argv])


def test_every_flag_of_the_script_is_accepted_and_reaches_the_options():
    options = options_from(launch_args(*SCRIPT_FLAGS))
    assert options == LaunchOptions(
        model_repo=Path("/models/repo"),
        world_size=1,
        tritonserver="/opt/tritonserver/bin/tritonserver",
        grpc_port=9001,
        http_port=9000,
        metrics_port=9002,
        log=True,
        log_file="my_log.txt",
        force=True,
        no_mpi=True,
        oversubscribe=True,
        multi_model=True,
        disable_spawn_processes=True,
        tensorrt_llm_model_name="tensorrt_llm,tensorrt_llm_draft",
        multimodal_gpu0_cuda_mem_pool_bytes=300000000,
    )
    short = options_from(launch_args("-f", "--world_size", "1", "--model_repo", "/r"))
    assert (
        short.force
        and short.tritonserver == "/opt/tritonserver/bin/tritonserver"
        and short.log_file == "triton_log.txt"
    )


def test_every_launch_flag_has_help_text():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    launch = sub.choices["launch"]
    for action in launch._actions:
        assert action.help, action.option_strings


def test_world_size_above_one_takes_one_engine_whose_tensor_parallel_size_matches(tmp_path):
    from tritonllm.checkpoints.tiny import build_tiny_model
    from tritonllm.deploy.followers import FollowerError, check_world_size, engine_config_of, rank_environment
    from tritonllm.deploy.repo import build_repo

    with pytest.raises(LaunchError, match="several tensorrt_llm models .* one parallel engine"):
        check_options(LaunchOptions(model_repo=tmp_path, world_size=2, tensorrt_llm_model_name="a,b"))
    repo = build_repo(build_tiny_model(tmp_path / "tiny"), tmp_path / "repo", guided_decoding_backend=None)
    config = engine_config_of(repo, "tensorrt_llm")  # what the model builds at load: its config.pbtxt's settings
    assert config.max_batch_size == 8 and config.tensor_parallel_size == 1
    with pytest.raises(
        FollowerError, match=r"--world_size 2 but .* 1 rank\(s\) \(tensor_parallel_size=1\): set tensor_par"
    ):
        check_world_size(config, 2, "tensorrt_llm")
    (repo / "tensorrt_llm" / "1" / "model.yaml").write_text("tensor_parallel_size: 2\n")
    check_world_size(engine_config_of(repo, "tensorrt_llm"), 2, "tensorrt_llm")
    with pytest.raises(FollowerError, match="missing/config.pbtxt does not exist"):
        engine_config_of(repo, "missing")
    config_path = repo / "tensorrt_llm" / "config.pbtxt"
    config_path.write_text(
        config_path.read_text().replace("{ count: 1 kind: KIND_CPU }", "{ count: 2 kind: KIND_CPU }")
    )
    with pytest.raises(FollowerError, match="instance_group asks for 2 instances; .* served by one"):
        engine_config_of(repo, "tensorrt_llm")
    env = rank_environment(1, 2, 1234, base={"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "TRITONLLM_RANK": "1",
        "TRITONLLM_WORLD_SIZE": "2",
        "TRITONLLM_LOCAL_RANK": "1",
        "TRITONLLM_MASTER_ADDR": "127.0.0.1",
        "TRITONLLM_MASTER_PORT": "1234",
    }
    from tritonllm.engine.embedded.parallel.environment import read_rank_environment

    read = read_rank_environment(env)  # what that rank's engine reads
    assert read is not None
    assert (read.launcher, read.rank, read.world_size, read.master_port) == ("tritonllm launch", 1, 2, 1234)


def test_bad_launch_options_are_refused_clearly(tmp_path):
    with pytest.raises(LaunchError, match="ports must differ"):
        check_options(LaunchOptions(model_repo=tmp_path, http_port=8001))
    with pytest.raises(LaunchError, match="is not a folder"):
        check_options(LaunchOptions(model_repo=tmp_path / "missing"))


def test_flags_without_effect_here_say_so(tmp_path):
    assert notes(LaunchOptions(model_repo=tmp_path)) == []
    said = notes(LaunchOptions(model_repo=tmp_path, oversubscribe=True, multi_model=True))
    assert any("--oversubscribe has no effect" in line for line in said)
    assert any("--multi-model" in line for line in said)


def test_a_missing_tritonserver_falls_back_to_the_bundled_one_saying_so(tmp_path):
    pytest.importorskip("pytriton")
    said: list[str] = []
    binary = find_tritonserver(str(tmp_path / "opt" / "tritonserver" / "bin" / "tritonserver"), said.append)
    assert binary.bundled and binary.path.is_file() and (binary.backend_dir / "python").is_dir()
    assert said and "does not exist; using the tritonserver bundled in nvidia-pytriton" in said[0]
    again: list[str] = []
    assert find_tritonserver(str(binary.path), again.append) == binary and again == []


def test_an_existing_tritonserver_is_used_with_its_own_backends(tmp_path):
    binary = tmp_path / "tritonserver" / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    (tmp_path / "tritonserver" / "backends" / "python").mkdir(parents=True)
    found = find_tritonserver(str(binary), lambda line: pytest.fail(line))
    assert found == Binary(binary, tmp_path / "tritonserver" / "backends", bundled=False)


def test_the_command_is_the_scripts_rank_zero_command(tmp_path):
    options = LaunchOptions(model_repo=tmp_path, grpc_port=1, http_port=2, metrics_port=3, log=True, log_file="l.txt")
    binary = Binary(Path("/bin/tritonserver"), Path("/backends"), bundled=True)
    assert server_command(options, binary, auto_complete=False) == [
        "/bin/tritonserver",
        f"--model-repository={tmp_path.resolve()}",
        "--grpc-port=1",
        "--http-port=2",
        "--metrics-port=3",
        "--log-verbose=3",
        "--log-file=l.txt",
        "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix0_",
        "--backend-directory=/backends",
    ]
    pooled = server_command(
        replace(options, log=False, multimodal_gpu0_cuda_mem_pool_bytes=7),
        Binary(Path("/t"), None, bundled=False),
        auto_complete=True,
    )
    assert "--cuda-memory-pool-byte-size=0:7" in pooled and "--disable-auto-complete-config" not in pooled
    assert not any(arg.startswith(("--log", "--backend-directory")) for arg in pooled)


def test_auto_complete_stays_on_only_for_the_llm_api_model(tmp_path):
    pytest.importorskip("tritonclient.grpc.model_config_pb2")
    model = tmp_path / "tensorrt_llm"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.yaml").write_text("model: x\n")
    (model / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\n')
    assert needs_auto_complete(tmp_path)
    (model / "config.pbtxt").write_text(
        'name: "tensorrt_llm"\nbackend: "python"\nmax_batch_size: 8\nmodel_transaction_policy { decoupled: true }\n'
    )
    assert not needs_auto_complete(tmp_path)


def fake_proc(root: Path, processes: dict[int, tuple[str, str]]) -> Path:
    for pid, (comm, state) in processes.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "comm").write_text(comm + "\n")
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 1 1\n")
    (root / "self").mkdir()
    return root


def test_other_tritonservers_are_refused_unless_forced(tmp_path):
    proc = fake_proc(tmp_path, {10: ("tritonserver", "S"), 11: ("python3", "R"), 12: ("tritonserver", "Z")})
    assert running_tritonservers(proc) == [10]
    with pytest.raises(LaunchError, match=r"PID\(s\): 10\. Use `kill 10` .* or pass --force"):
        check_no_other_server(False, print, proc)
    said: list[str] = []
    check_no_other_server(True, said.append, proc)
    assert "--force: launching regardless" in said[0]


def test_a_busy_port_is_found():
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert busy_ports([port]) == [port]
    assert busy_ports([port]) == []


def test_launch_refuses_before_starting_when_the_repository_would_not_load(tmp_path, monkeypatch):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\nmax_batch_size: ${triton_max_batch_size}\n')
    monkeypatch.setattr(launch_module.subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    monkeypatch.setattr(launch_module, "find_tritonserver", lambda *_: Binary(Path("/t"), None, bundled=False))
    with pytest.raises(LaunchError, match=r"would not load:\n.*max_batch_size holds the unfilled placeholder"):
        launch_module.launch(LaunchOptions(model_repo=tmp_path, force=True), say=print)


def test_a_failed_start_logged_to_the_log_file_names_the_model_and_the_cause(tmp_path):
    log = tmp_path / "triton_log.txt"
    log.write_text(
        "E1201 19:56:28.686724 23827 model_lifecycle.cc:642] \"failed to load 'tensorrt_llm' version 1: Internal: "
        "ParameterError: tensorrt_llm: parameter 'max_beam_width' = 'two' must be an integer\\n\\nAt:\\n  "
        '/src/backend/triton/params.py(59): _get\\n"\n'
    )
    options = LaunchOptions(model_repo=str(tmp_path), log=True, log_file=str(log))
    text = launch_module._failed_start(1, options)
    assert text.endswith("model 'tensorrt_llm': parameter 'max_beam_width' = 'two' must be an integer"), text
    without_log = launch_module._failed_start(1, replace(options, log=False))
    assert without_log == "tritonserver exited with code 1 while loading the models"


def test_an_outside_launchers_rank_and_rank_0s_environment():
    from tritonllm.deploy.launcher_ranks import RankError, leader_environment, outside_rank

    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "MASTER_ADDR": "node0", "PATH": "/bin"}
    env = outside_rank(2, slurm)
    assert env is not None and (env.launcher, env.rank, env.world_size) == ("Slurm", 0, 2)
    with pytest.raises(RankError, match="--world_size 4 but the Slurm environment has 2 rank"):
        outside_rank(4, slurm)
    assert outside_rank(2, {"TRITONLLM_RANK": "1", "TRITONLLM_WORLD_SIZE": "2"}) is None  # our own launch's
    assert outside_rank(2, {"PATH": "/bin"}) is None
    leader = leader_environment(env, slurm)
    assert not {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR"} & set(leader)
    assert leader["PATH"] == "/bin" and leader["TRITONLLM_RANK"] == "0" and leader["TRITONLLM_WORLD_SIZE"] == "2"
    assert leader["TRITONLLM_MASTER_ADDR"] == "node0" and leader["TRITONLLM_MASTER_PORT"] == "29500"


def test_a_sigterm_while_rank_0s_server_starts_stops_it(monkeypatch, tmp_path):
    """Under an outside launcher, the job may be ended while tritonserver is still starting: the SIGTERM then
    interrupts launch's start (which stops the server it started) instead of killing launch and orphaning it."""
    import os
    import signal
    import time

    from tritonllm.commands import launch as launch_command

    def starting(options, say):  # launch's readiness wait, interrupted by the launcher's SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("the SIGTERM did not interrupt the start")

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_command, "launch", starting)

    def unhandled(_signum, _frame):  # what the SIGTERM would meet without launch's own handler (not a dead test run)
        raise AssertionError("launch left SIGTERM unhandled during the start")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        args = build_parser().parse_args(["launch", "--world_size", "2", f"--model_repo={tmp_path}"])
        assert launch_command.main(args) == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
