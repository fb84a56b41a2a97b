"""Faults on the real tritonserver: a killed `tensorrt_llm` stub under load (the supervisor `tritonllm serve` runs
restarts the server: no request hangs, readiness drops, serving resumes), a killed tritonserver whose stubs end
with it (none left holding memory under init), and model folders left untouched by the stubs (no bytecode written
there)."""

from __future__ import annotations

import os
import signal
import threading
import time

import e2e_clients as clients
import pytest

from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.supervisor import Supervisor, stub_processes
from tritonllm.deploy.tritonserver import Ports, TritonServer
from tritonllm.triton.parent_watch import proc_stat_fields

from .conftest import MAX_SEQ_LEN

pytestmark = pytest.mark.server

IN_FLIGHT = 8
PROMPT = "The lamp turned and turned"


@pytest.fixture(scope="module", params=[True, False], ids=["decoupled", "one-response"])
def supervised(request, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("supervised")
    repo = build_repo(tiny_model, work / "repo", streaming=request.param, max_seq_len=MAX_SEQ_LEN)
    triton = TritonServer(repo, Ports.free(), log_file=work / "tritonserver.log").start(timeout=180)
    supervisor = Supervisor(triton, start_timeout=180)
    watcher = threading.Thread(target=supervisor.run, daemon=True)
    watcher.start()
    try:
        yield clients.LiveServer(triton, work / "tritonserver.log", MAX_SEQ_LEN), supervisor, request.param
    finally:
        supervisor.stop.set()
        watcher.join(30)
        triton.stop()


def long_request(server: clients.LiveServer, decoupled: bool, outcome: dict, index: int) -> None:
    """An ensemble request far longer than the test (streamed where the repository is decoupled), on a gRPC
    stream; records when and how it ended."""
    body = {"text_input": clients.strings(PROMPT), "max_tokens": clients.scalar(MAX_SEQ_LEN - 16, "int32")}
    if decoupled:
        body["stream"] = clients.scalar(True, "bool")
    stream = server.grpc_stream()
    try:
        stream.send("ensemble", body, request_id=f"load-{index}")
        reply = stream.collect(timeout=120)
        outcome[index] = (time.monotonic(), reply)
    except AssertionError as exc:  # collect's own timeout: the request hung
        outcome[index] = (time.monotonic(), exc)
    finally:
        try:
            stream.close()
        except Exception:  # the server went away under it
            pass


def test_a_killed_stub_fails_its_requests_and_the_server_serves_again(supervised):
    server, supervisor, decoupled = supervised
    tensorrt_llm = [pid for pid, model in stub_processes(server.triton.process.pid).items() if model == "tensorrt_llm"]
    assert len(tensorrt_llm) == 1, stub_processes(server.triton.process.pid)
    outcome: dict = {}
    threads = [threading.Thread(target=long_request, args=(server, decoupled, outcome, i)) for i in range(IN_FLIGHT)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while server.metrics().get(("nv_trt_llm_request_metrics", "active"), 0) < IN_FLIGHT:
        assert time.monotonic() < deadline, "the requests never all reached the engine"
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(tensorrt_llm[0], signal.SIGKILL)

    while server.triton.is_ready():
        assert time.monotonic() - killed < 5, "still ready 5 s after the stub died"
        time.sleep(0.1)
    for thread in threads:
        thread.join(15)
    ended = {i: (at - killed, reply) for i, (at, reply) in outcome.items()}
    assert len(ended) == IN_FLIGHT, f"only {len(ended)} of {IN_FLIGHT} requests ended"
    for index, (after, reply) in ended.items():
        assert isinstance(reply, clients.StreamReply) and reply.error is not None, (index, reply)
        assert after < 10, f"request {index} ended {after:.1f}s after the kill"
    while not server.triton.is_ready():
        assert time.monotonic() - killed < 30, "not serving again 30 s after the stub died"
        time.sleep(0.2)
    assert len(supervisor.restarts) == 1
    text = server.generate({"text_input": PROMPT, "max_tokens": 4, "bad_words": "", "stop_words": ""})
    assert text["text_output"].startswith(PROMPT)


def test_the_stubs_write_no_bytecode_into_the_model_folders(server):
    server.generate({"text_input": PROMPT, "max_tokens": 2, "bad_words": "", "stop_words": ""})
    repo = server.triton.repo
    written = sorted(
        str(path) for path in repo.rglob("*") if path.suffix == ".pyc" or (path.name == "__pycache__" and path.is_dir())
    )
    assert written == [], f"Triton would take these model folders for changed ones: {written}"
    assert (repo / "tensorrt_llm" / "1" / "__pycache__").is_file()  # what keeps Python from writing there


def test_a_killed_tritonserver_leaves_no_model_process(tiny_model, tmp_path):
    """SIGKILL to tritonserver alone, with requests streaming: every stub ends within seconds (parent_watch), also
    one whose threads wait on the dead server for an answer while they hold the GIL."""
    repo = build_repo(tiny_model, tmp_path / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    triton = TritonServer(repo, Ports.free(), log_file=tmp_path / "tritonserver.log").start(timeout=180)
    server = clients.LiveServer(triton, tmp_path / "tritonserver.log", MAX_SEQ_LEN)
    try:
        stubs = stub_processes(triton.started_process.pid)
        assert len(stubs) == 4, stubs
        outcome: dict = {}
        threads = [threading.Thread(target=long_request, args=(server, True, outcome, i)) for i in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while server.metrics().get(("nv_trt_llm_request_metrics", "active"), 0) < 4:
            assert time.monotonic() < deadline, "the requests never all reached the engine"
            time.sleep(0.05)
        os.kill(triton.started_process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while [pid for pid in stubs if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in stubs if _alive(pid)], f"stubs outlived tritonserver: {stubs}"
        for thread in threads:
            thread.join(15)
        assert len(outcome) == 4, "a client was left hanging"
    finally:
        triton.kill()


def _alive(pid: int) -> bool:
    try:
        return proc_stat_fields(pid)[0] != "Z"
    except OSError:
        return False
