"""tritonserver stops cleanly (exit code 0, within its exit timeout, no Python-backend stub left behind) after
many gRPC stream calls to tensorrt_llm, the way the BLS makes them."""
import subprocess

import numpy as np

from tritonllm.bls.llm_calls import GrpcTransport
from tritonllm.repo import build_repo
from tritonllm.server import Ports, TritonServer

from .conftest import MAX_SEQ_LEN


def _call_inputs(streaming: bool) -> dict:
    context = [5, 6, 7, 8, 9, 10]
    return {"input_ids": np.array([context], dtype=np.int32),
            "input_lengths": np.array([[len(context)]], dtype=np.int32),
            "request_output_len": np.array([[3]], dtype=np.int32), "end_id": np.array([[-1]], dtype=np.int32),
            "streaming": np.array([[streaming]]), "exclude_input_in_output": np.array([[True]])}


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


def test_shutdown_after_cancelled_ensemble_streams_is_bounded_and_leaves_no_stub(tiny_model, tmp_path):
    """Triton 2.51 never completes an ensemble request whose gRPC stream the client cancelled (docs/faults.md):
    tritonserver then runs out its exit timeout. `stop` still returns within that timeout plus its grace, and
    kills what the server left behind."""
    import time

    import e2e_clients as clients
    from tritonllm.server import STOP_GRACE_S

    repo = build_repo(tiny_model, tmp_path / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    triton = TritonServer(repo, Ports.free(), log_file=tmp_path / "tritonserver.log",
                          exit_timeout_secs=3).start(timeout=180)
    try:
        live = clients.LiveServer(triton, tmp_path / "tritonserver.log", MAX_SEQ_LEN)
        body = {"text_input": clients.strings("The lamp turned"), "max_tokens": clients.scalar(200, "int32"),
                "stream": clients.scalar(True, "bool")}
        for index in range(3):
            stream = live.grpc_stream()
            stream.send("ensemble", body, request_id=f"cancelled-{index}")
            reply = clients.StreamReply()
            while len(reply.results) < 2 and not reply.finished:
                clients.add_event(reply, *stream.next_event(timeout=30))
            stream.close(cancel=True)
    finally:
        started = time.monotonic()
        triton.stop()
        took = time.monotonic() - started
    left = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub {repo}"], capture_output=True, text=True)
    assert took < triton.exit_timeout_secs + STOP_GRACE_S + 5, f"stop took {took:.1f}s"
    assert not left.stdout.strip(), f"stubs left behind: {left.stdout}"
