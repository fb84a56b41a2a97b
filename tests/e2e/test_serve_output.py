"""`tritonllm serve`'s own output on the real tritonserver: a failed start ends with which model failed and why
(no traceback for a bad parameter, everything with --verbose), a tokenizer folder that lost its tokenizer is
refused before tritonserver starts, and a good start shows the engine's progress without the GPU-less noise."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.server_log import is_gpu_noise
from tritonllm.deploy.tritonserver import free_port

pytestmark = pytest.mark.server

BAD_BEAM = "parameter 'max_beam_width' = 'two' must be an integer"


def serve_command(*args: str) -> list[str]:
    ports = [str(free_port()) for _ in range(3)]
    return [
        sys.executable,
        "-m",
        "tritonllm",
        "serve",
        *args,
        "--http-port",
        ports[0],
        "--grpc-port",
        ports[1],
        "--metrics-port",
        ports[2],
    ]


@pytest.fixture(scope="module")
def bad_repo(tiny_model, tmp_path_factory) -> Path:
    repo = build_repo(tiny_model, tmp_path_factory.mktemp("bad_param") / "repo")
    config = repo / "tensorrt_llm" / "config.pbtxt"
    text = config.read_text()
    assert 'key: "max_beam_width" value: { string_value: "1" }' in text
    config.write_text(
        text.replace(
            'key: "max_beam_width" value: { string_value: "1" }', 'key: "max_beam_width" value: { string_value: "two" }'
        )
    )
    return repo


def run_serve(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        serve_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )


def test_a_failed_start_ends_with_the_model_and_its_parameter(bad_repo, tmp_path):
    log_file = tmp_path / "server.log"
    result = run_serve("--repo", str(bad_repo), "--log-file", str(log_file))
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 2, result.stdout
    assert lines[-3:-1] == [
        "tritonllm: error: tritonserver exited with code 1 while starting:",
        f"  model 'tensorrt_llm': {BAD_BEAM}",
    ], result.stdout
    assert lines[-1] == f"  (the whole server log: {log_file})"
    assert "Traceback" not in result.stdout and "params.py" not in result.stdout  # a user's mistake: no frames
    assert not [line for line in lines if is_gpu_noise(line)]
    logged = log_file.read_text()
    assert "params.py" in logged  # the log file keeps everything, Triton's frames included
    if "Failed to initialize NVML" in logged:  # a machine without a GPU: its noise is filtered, not lost
        assert "Failed to initialize NVML" not in result.stdout


def test_verbose_shows_everything(bad_repo, tmp_path):
    log_file = tmp_path / "server.log"
    result = run_serve("--repo", str(bad_repo), "--verbose", "--log-file", str(log_file))
    assert result.returncode == 2
    assert f"model 'tensorrt_llm': {BAD_BEAM}" in result.stdout
    assert "Traceback (most recent call last)" in result.stdout  # ours, with --verbose
    shown = set(result.stdout.splitlines())
    assert [line for line in log_file.read_text().splitlines() if line not in shown] == []  # nothing filtered


def test_a_tokenizer_folder_without_tokenizer_is_refused_before_tritonserver_starts(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    repo = build_repo(model, tmp_path / "repo")
    (model / "tokenizer.json").unlink()
    started = time.monotonic()
    result = run_serve("--repo", str(repo), timeout=60)
    assert result.returncode == 2 and "starting tritonserver" not in result.stdout
    (last,) = result.stdout.strip().splitlines()[-1:]
    assert last.startswith(f"tritonllm: error: {repo / 'preprocessing' / 'config.pbtxt'}: parameter 'tokenizer_dir'")
    assert f"the folder {model} holds no tokenizer" in last and "sentencepiece" not in result.stdout
    assert time.monotonic() - started < 30  # no model imported torch


def test_sigterm_while_starting_stops_the_server_without_a_traceback(tiny_model, tmp_path):
    repo = build_repo(tiny_model, tmp_path / "repo")
    output = tmp_path / "serve.out"
    with output.open("w") as sink:
        process = subprocess.Popen(serve_command("--repo", str(repo)), stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "loading: tensorrt_llm" not in output.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        server_pids = _children(process.pid)
        assert server_pids, output.read_text()
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(60)
    assert process.returncode == 0 and "Traceback" not in output.read_text(), output.read_text()
    assert "[serve] stopping tritonserver" in output.read_text()
    assert not [pid for pid in server_pids if Path(f"/proc/{pid}").exists()]  # tritonserver did not outlive serve


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_a_good_start_shows_progress_and_no_gpu_noise(tiny_model, tmp_path):
    repo = build_repo(tiny_model, tmp_path / "repo")
    log_file = tmp_path / "server.log"
    command = serve_command("--repo", str(repo), "--log-file", str(log_file))
    output = tmp_path / "serve.out"
    with output.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "[serve] ready." not in output.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "[serve] ready." in output.read_text(), output.read_text()
    finally:
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(process.pid, signal.SIGTERM)  # a second one while it stops: ignored, the stop completes
        process.wait(60)
    assert process.returncode == 0 and "Traceback" not in output.read_text()
    lines = output.read_text().splitlines()
    engine = [line for line in lines if "[tritonllm.engine]" in line]
    assert any(" [tritonllm.engine] engine code imported (torch with it) in " in line for line in engine), lines
    assert any(" [tritonllm.engine] loading weights: done, " in line for line in engine), lines
    assert any(" [tritonllm.engine] embedded engine ready in " in line for line in engine)
    assert all(line[:9].count(":") == 2 and "logging_bridge.py" not in line for line in engine)  # HH:MM:SS [logger]
    assert not [line for line in lines if is_gpu_noise(line)]
    assert "loading weights: done" in log_file.read_text()
