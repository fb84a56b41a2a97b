"""`tritonllm launch` with the command line of the TensorRT-LLM backend's launch_triton_server.py: it finds the
bundled tritonserver itself, returns once the server is ready, the server answers through the ensemble, and
`kill PID` stops it and its model processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
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


def _launch_two_ranks(repo: Path, tmp_path: Path, sizes: str = "tensor_parallel_size: 2") -> tuple[Ports, int, int]:
    """`tritonllm launch --world_size 2` on `repo` with `sizes` in the engine's model.yaml: (ports, tritonserver's
    PID, the follower's PID)."""
    (repo / "tensorrt_llm" / "1" / "model.yaml").write_text(sizes + "\n")
    ports = Ports.free()
    command = [sys.executable, "-m", "tritonllm", "launch", "--world_size", "2", f"--model_repo={repo}", "--force"]
    command += [f"--http_port={ports.http}", f"--grpc_port={ports.grpc}", f"--metrics_port={ports.metrics}"]
    command += ["--log", "--log-file", str(tmp_path / "triton_log.txt")]
    command += ["--ready-timeout", "240"]  # the launcher stops what it started before this test gives up on it
    output = tmp_path / "launch.out"
    with output.open("w") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=300).returncode
    text = output.read_text(errors="replace")
    match, ranks = re.search(r"tritonserver ready \(PID (\d+)\)", text), re.search(r"followers \(PIDs (\d+)\)", text)
    assert code == 0 and match and ranks, text
    return ports, int(match.group(1)), int(ranks.group(1))


def _direct_generate(ports: Ports, prompt: list[int], end_id: int) -> tuple[int, dict]:
    from .clients import direct_request, generate_body

    body = generate_body(direct_request(prompt, 8, end_id, exclude_input_in_output=True))
    request = urllib.request.Request(
        f"http://localhost:{ports.http}/v2/models/tensorrt_llm/generate", data=json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_gone(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.parametrize("sizes", ["tensor_parallel_size: 2", "pipeline_parallel_size: 2"])
def test_launch_world_size_two_serves_rank_zero_in_tritonserver_with_a_follower(tiny_model, tmp_path, sizes):
    """Leader mode on CPU with gloo: the tensorrt_llm model's engine is rank 0 of two (two tensor ranks, or two
    pipeline stages), a `tritonllm follow` process rank 1; greedy tokens through the real server equal one rank's,
    and both ranks stop with the server."""
    from tritonllm.deploy.followers import engine_config_of
    from tritonllm.engine.embedded.engine import EmbeddedEngine
    from tritonllm.engine.types import SamplingParams

    repo = build_repo(tiny_model, tmp_path / "repo", streaming=False, guided_decoding_backend=None)
    prompt, end_id = [5, 17, 42, 99, 3, 250, 7], 2
    single = EmbeddedEngine(engine_config_of(repo, "tensorrt_llm"))  # what one rank gives for the same settings
    try:
        expected = single.generate(prompt, SamplingParams(max_tokens=8, end_id=end_id)).outputs[0].token_ids
    finally:
        single.shutdown()
    ports, pid, follower = _launch_two_ranks(repo, tmp_path, sizes)
    try:
        status, reply = _direct_generate(ports, prompt, end_id)
        assert status == 200 and reply["output_ids"] == expected, (reply, expected)
    finally:
        subprocess.run(["kill", str(pid)], check=False)
        _wait_gone([pid, follower], 40)
    assert _gone(pid), "tritonserver did not stop on SIGTERM"
    follower_log = (tmp_path / "follower-1.log").read_text()
    assert _gone(follower), "the follower outlived rank 0: " + follower_log[-2000:]
    assert "rank 1 stops after" in follower_log and "Traceback" not in follower_log, follower_log[-3000:]


def test_a_lost_follower_fails_the_request_and_stops_the_server(tiny_model, tmp_path):
    repo = build_repo(tiny_model, tmp_path / "repo", streaming=False, guided_decoding_backend=None)
    ports, pid, follower = _launch_two_ranks(repo, tmp_path)
    try:
        subprocess.run(["kill", "-9", str(follower)], check=False)
        _wait_gone([follower], 10)
        status, reply = _direct_generate(ports, [5, 17, 42], 2)  # rank 0 finds the follower gone in this step
        assert status != 200 and "another rank is gone" in reply.get("error", ""), (status, reply)
        _wait_gone([pid], 40)  # and then stops the server instead of staying ready
        assert _gone(pid), "tritonserver kept running after its engine lost a rank"
    finally:
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert "stopping tritonserver" in (tmp_path / "triton_log.txt").read_text()


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


def test_launch_on_every_rank_of_an_outside_launcher(tiny_model, tmp_path):
    """As under mpirun / srun / torchrun: the same `tritonllm launch --world_size 2` on two ranks (torchrun's
    variables here); rank 0 serves tritonserver in the foreground, rank 1 the engine only; the tokens are one
    rank's, and SIGTERM to rank 0's command stops the server and then the other rank."""
    import os
    import signal

    from tritonllm.deploy.followers import engine_config_of
    from tritonllm.deploy.tritonserver import free_port
    from tritonllm.engine.embedded.engine import EmbeddedEngine
    from tritonllm.engine.types import SamplingParams

    repo = build_repo(tiny_model, tmp_path / "repo", streaming=False)
    prompt, end_id = [5, 17, 42, 99, 3, 250, 7], 2
    single = EmbeddedEngine(engine_config_of(repo, "tensorrt_llm"))  # before model.yaml asks for two stages
    (repo / "tensorrt_llm" / "1" / "model.yaml").write_text("pipeline_parallel_size: 2\n")
    try:
        expected = single.generate(prompt, SamplingParams(max_tokens=8, end_id=end_id)).outputs[0].token_ids
    finally:
        single.shutdown()
    ports, master = Ports.free(), free_port()
    command = [sys.executable, "-m", "tritonllm", "launch", "--world_size", "2", f"--model_repo={repo}", "--force"]
    command += [f"--http_port={ports.http}", f"--grpc_port={ports.grpc}", f"--metrics_port={ports.metrics}"]
    ranks = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
        out = (tmp_path / f"rank{rank}.out").open("w")
        ranks.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 240
        while not _ready(ports):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), _outputs(tmp_path)
            time.sleep(0.5)
        status, reply = _direct_generate(ports, prompt, end_id)
        assert status == 200 and reply["output_ids"] == expected, (reply, expected)
        # The server answers before launch's own readiness wait ends: SIGTERM it once it serves in the foreground.
        serving = "rank 0 of 2 under torchrun: serving until tritonserver exits"
        while serving not in (tmp_path / "rank0.out").read_text(errors="replace"):
            assert time.monotonic() < deadline and ranks[0].poll() is None, _outputs(tmp_path)
            time.sleep(0.1)
        ranks[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in ranks]  # a loaded CI machine once took over 60 s
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = "\n".join((tmp_path / f"rank{r}.out").read_text(errors="replace") for r in range(2))
    assert codes[1] == 0, text[-3000:]  # rank 1 stopped when rank 0's engine did
    assert "rank 1 of 2 under torchrun: this rank runs the engine only" in text
    assert serving in text


def _ready(ports: Ports) -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{ports.http}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _outputs(tmp_path: Path) -> str:
    return "\n".join((tmp_path / f"rank{r}.out").read_text(errors="replace")[-3000:] for r in range(2))
