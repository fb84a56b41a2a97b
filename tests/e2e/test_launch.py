"""`tritonllm launch` with the command line of the TensorRT-LLM backend's launch_triton_server.py: it finds the
bundled tritonserver itself, returns once the server is ready, the server answers through the ensemble, and
`kill PID` stops it and its model processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tritonllm.deploy.launch import busy_ports
from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports

pytestmark = pytest.mark.server


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_launch_with_the_scripts_flags_serves_and_stops_cleanly(tiny_model, tmp_path):
    repo = build_repo(tiny_model, tmp_path / "repo", streaming=False)
    ports = Ports.free()
    log_file = tmp_path / "triton_log.txt"
    command = [sys.executable, "-m", "tritonllm", "launch", "--world_size", "1", f"--model_repo={repo}"]
    command += ["--tritonserver", "/opt/tritonserver/bin/tritonserver"]  # the script's default path
    command += [f"--http_port={ports.http}", f"--grpc_port={ports.grpc}", f"--metrics_port={ports.metrics}"]
    command += ["--log", "--log-file", str(log_file), "--force", "--no-mpi"]  # --force: other tests' servers
    output = tmp_path / "launch.out"
    with output.open("w") as sink:  # the server inherits it: a pipe would stay open until the server ends
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=300).returncode
    text = output.read_text(errors="replace")
    match = re.search(r"tritonserver ready \(PID (\d+)\)", text)
    assert code == 0 and match, text
    pid = int(match.group(1))
    try:
        if not Path("/opt/tritonserver/bin/tritonserver").exists():
            assert "does not exist; using the tritonserver bundled in nvidia-pytriton" in text
        body = json.dumps(
            {"text_input": "The capital of France is", "max_tokens": 6, "bad_words": "", "stop_words": ""}
        )
        request = urllib.request.Request(
            f"http://localhost:{ports.http}/v2/models/ensemble/generate", data=body.encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
        assert reply["text_output"].startswith("The capital of France is") and len(reply["text_output"]) > 24
        assert "--log-verbose=3" in text and log_file.stat().st_size > 0  # --log: verbose log in --log-file
    finally:
        subprocess.run(["kill", str(pid)], check=False)
        deadline = time.monotonic() + 40
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert _gone(pid), "tritonserver did not stop on SIGTERM"
    left = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub {repo}"], capture_output=True, text=True)
    assert not left.stdout.strip(), "a model process outlived the server"
    assert busy_ports([ports.http, ports.grpc, ports.metrics]) == []


def test_launch_refuses_a_repository_for_the_cpp_backend_before_starting(tiny_model, tmp_path):
    repo = build_repo(tiny_model, tmp_path / "repo", streaming=False)
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "python"', 'backend: "tensorrtllm"', 1))
    ports = Ports.free()
    result = subprocess.run(
        [sys.executable, "-m", "tritonllm", "launch", f"--model_repo={repo}", f"--http_port={ports.http}"]
        + [f"--grpc_port={ports.grpc}", f"--metrics_port={ports.metrics}", "--force"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "backend 'tensorrtllm' is not in" in result.stderr and "triton_backend:python" in result.stderr
    assert "starting" not in result.stdout
