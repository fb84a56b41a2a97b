"""tritonserver stops cleanly (exit code 0, within its exit timeout, no Python-backend stub left behind) after
many gRPC stream calls to tensorrt_llm, the way the BLS makes them, and after clients cancelled their streams to
the ensemble."""

import json
import re
import subprocess
import urllib.request

import numpy as np
import pytest

from tritonllm.bls.llm_calls import GrpcTransport
from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports, TritonServer

from .conftest import MAX_SEQ_LEN

pytestmark = pytest.mark.server
CANCELLED_STREAMS = 20
STREAMED_TOKENS = 2000  # a stream asks for many: the cancel must stop it
# The cancel reaches the generation once postprocessing has answered the responses queued before it: on a
# loaded 2-core machine one of 20 streams once ran past 500 tokens. Half of STREAMED_TOKENS still tells a
# stopped generation from one that ran to its end.
STOPPED_BY = 1000  # a bucket of nv_llm_output_token_len
UNSTREAMED_TOKENS = 100  # nothing stops those before their end (docs/faults.md): kept short


def _call_inputs(streaming: bool) -> dict:
    context = [5, 6, 7, 8, 9, 10]
    return {
        "input_ids": np.array([context], dtype=np.int32),
        "input_lengths": np.array([[len(context)]], dtype=np.int32),
        "request_output_len": np.array([[3]], dtype=np.int32),
        "end_id": np.array([[-1]], dtype=np.int32),
        "streaming": np.array([[streaming]]),
        "exclude_input_in_output": np.array([[True]]),
    }


def test_server_stops_cleanly_after_many_bls_style_stream_calls(tiny_model, tmp_path):
    """Each call is one request on its own gRPC stream. Cancelling such a stream right after its final response
    raced the server's own completion, and tritonserver then waited forever for a cancellation callback: the
    model never unloaded, the exit timeout expired (exit code 1) and the model's stub process was orphaned."""
    repo = build_repo(tiny_model, tmp_path / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    triton = TritonServer(repo, Ports.free(), log_file=tmp_path / "tritonserver.log").start(timeout=180)
    try:
        transport = GrpcTransport(triton.grpc_url, "tensorrt_llm")
        for index in range(12):
            responses = list(transport.start(_call_inputs(streaming=index % 2 == 0), f"call-{index}").responses())
            assert responses and responses[-1].final
        transport.close()
    finally:
        code = triton.stop()
    left = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub {repo}"], capture_output=True, text=True)
    assert code == 0, (tmp_path / "tritonserver.log").read_text(errors="replace")[-3000:]
    assert not left.stdout.strip()


def _repository_states(triton) -> dict[str, str]:
    request = urllib.request.Request(f"http://{triton.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return {entry["name"]: entry.get("state", "") for entry in json.loads(response.read())}


def _step_counts(triton) -> str:
    """Each model's requests as Triton counts them (succeeded, failed, queued): where an unfinished ensemble
    request's step went, for a failure message."""
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/models/stats", timeout=30) as response:
        models = json.loads(response.read()).get("model_stats", [])
    counts = {
        entry["name"]: {kind: entry["inference_stats"][kind]["count"] for kind in ("success", "fail", "queue")}
        for entry in models
    }
    return f"requests a model: {counts}"


def _unload(triton, model: str) -> None:
    request = urllib.request.Request(
        f"http://{triton.http_url}/v2/repository/models/{model}/unload",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def _requests_with_at_most(live, tokens: int) -> float:
    """How many finished tensorrt_llm requests generated at most `tokens` (nv_llm_output_token_len's bucket)."""
    import e2e_clients as clients

    return sum(
        sample.value
        for sample in clients.parse_samples(live.metrics_text())
        if sample.name == "nv_llm_output_token_len_bucket"
        and sample.labels.get("model") == "tensorrt_llm"
        and sample.labels.get("le") == str(tokens)
    )


@pytest.mark.parametrize("streaming", [True, False], ids=["decoupled", "one-response"])
def test_cancelled_ensemble_streams_end_so_unload_and_shutdown_complete(tiny_model, tmp_path, streaming):
    """A client cancelling its gRPC stream to the ensemble (stop_stream(cancel_requests=True)) cancels the
    ensemble request; Triton 2.51 hands that cancel only to the steps it schedules afterwards. Every step still
    answers, the generation stops, so Triton completes each ensemble request: its KV blocks come back, an
    unload of the ensemble reaches UNAVAILABLE, and the server exits cleanly within its exit timeout."""
    import time

    import e2e_clients as clients

    repo = build_repo(tiny_model, tmp_path / "repo", streaming=streaming, max_seq_len=MAX_SEQ_LEN)
    triton = TritonServer(
        repo, Ports.free(), log_file=tmp_path / "tritonserver.log", exit_timeout_secs=10, explicit_model_control=True
    ).start(timeout=180)
    log_tail = lambda: (tmp_path / "tritonserver.log").read_text(errors="replace")[-3000:]  # noqa: E731
    try:
        live = clients.LiveServer(triton, tmp_path / "tritonserver.log", MAX_SEQ_LEN)
        max_tokens = STREAMED_TOKENS if streaming else UNSTREAMED_TOKENS
        body = {
            "text_input": clients.strings("The lamp turned"),
            "max_tokens": clients.scalar(max_tokens, "int32"),
            "stream": clients.scalar(streaming, "bool"),
        }
        for index in range(CANCELLED_STREAMS):
            stream = live.grpc_stream()
            stream.send("ensemble", body, request_id=f"cancelled-{index}" if index % 2 else "")
            if streaming:  # cancelled mid-stream, after a few responses
                reply = clients.StreamReply()
                while len(reply.results) < 2 and not reply.finished:
                    clients.add_event(reply, *stream.next_event(timeout=30))
            else:  # cancelled while the one response is being generated
                time.sleep(0.2)
            stream.close(cancel=True)
        gauges = live.wait_engine_idle(timeout=60)
        assert clients.engine_is_idle(gauges), f"the cancelled generations still run or hold blocks: {gauges}"
        if streaming:  # the stop reached the generation: none ran on to its STREAMED_TOKENS
            assert _requests_with_at_most(live, STOPPED_BY) == CANCELLED_STREAMS, log_tail()
        _unload(triton, "ensemble")
        deadline = time.monotonic() + 20
        while _repository_states(triton).get("ensemble") != "UNAVAILABLE":
            assert time.monotonic() < deadline, (  # (the message, counts included, is built only on failure)
                f"unload did not finish: {_repository_states(triton)}\n{_step_counts(triton)}\n{log_tail()}"
            )
            time.sleep(0.2)
    finally:
        started = time.monotonic()
        code = triton.stop()
        took = time.monotonic() - started
    left = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub {repo}"], capture_output=True, text=True)
    assert code == 0, f"tritonserver exited with {code} after {took:.1f}s\n{log_tail()}"
    assert not re.search(r"has [1-9]\d* in-flight inferences|Exit timeout expired", log_tail()), log_tail()
    assert not left.stdout.strip(), f"stubs left behind: {left.stdout}"
