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
