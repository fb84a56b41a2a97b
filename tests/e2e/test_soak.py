"""Mixed traffic with faults on the real tritonserver, both modes: concurrent ensemble requests, streams to
`tensorrt_llm` of which some are cancelled by their client, `stop` requests by id, bad inputs; then unload /
reload cycles of the whole repository and a shutdown. Nothing may hang, fail unexpectedly, or keep a KV block.

Short in CI (SOAK_REQUESTS, SOAK_CYCLES below). The long run of docs/faults.md:
`TRITONLLM_SOAK=long pytest tests/e2e/test_soak.py -s` (10,000 requests, 100 reload cycles or
TRITONLLM_SOAK_CYCLES; it prints its figures and checks that the server's memory grows under 1% over the cycles)."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import e2e_clients as clients
import pytest
import tritonclient.grpc as grpcclient

from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports, TritonServer

from .conftest import MAX_SEQ_LEN

LONG = os.environ.get("TRITONLLM_SOAK") == "long"
pytestmark = [pytest.mark.server, pytest.mark.timeout(0 if LONG else 900)]  # the long run takes about an hour
SOAK_REQUESTS = 10_000 if LONG else 400
SOAK_CYCLES = int(os.environ.get("TRITONLLM_SOAK_CYCLES", 100)) if LONG else 2
CONCURRENCY = 8  # the repository's max_batch_size: more only queues (and ran ten times slower here)
HANG_S = 60  # a request not answered by then is hung
PROMPTS = ["Hello there", "The lamp turned and turned", "北京", "Once upon a time"]


@pytest.fixture(scope="module", params=[True, False], ids=["decoupled", "one-response"])
def soak_server(request, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("soak")
    repo = build_repo(tiny_model, work / "repo", streaming=request.param, max_seq_len=MAX_SEQ_LEN)
    triton = TritonServer(
        repo, Ports.free(), log_file=work / "tritonserver.log", exit_timeout_secs=10, explicit_model_control=True
    ).start(timeout=180)
    try:
        yield clients.LiveServer(triton, work / "tritonserver.log", MAX_SEQ_LEN), request.param
    finally:
        code = triton.stop()
        assert code == 0, (
            f"tritonserver exited with {code}: " + (work / "tritonserver.log").read_text(errors="replace")[-2000:]
        )


# ---------------------------------------------------------------------------------------------- request kinds


def ensemble_text(server, rng, decoupled) -> str:
    prompt = rng.choice(PROMPTS)
    text = server.generate({"text_input": prompt, "max_tokens": rng.randint(1, 24), "bad_words": "", "stop_words": ""})[
        "text_output"
    ]
    assert text.startswith(prompt), text
    return "ok"


def bad_input(server, rng, decoupled) -> str:
    body = rng.choice(
        [{"text_input": "x", "max_tokens": -3}, {"text_input": "x", "max_tokens": 4, "temperature": -1.0}]
    )
    status, message = server.generate_error({**body, "bad_words": "", "stop_words": ""})
    assert status == 400 and ("max_tokens" in message or "temperature" in message), (status, message)
    return "refused"


def cancelled_stream(server, rng, decoupled) -> str:
    """A stream to tensorrt_llm or to the ensemble whose client cancels it after a few responses (decoupled
    only)."""
    if not decoupled:
        return ensemble_text(server, rng, decoupled)
    model = rng.choice(["tensorrt_llm", "ensemble"])
    if model == "ensemble":
        inputs = {
            "text_input": clients.strings(rng.choice(PROMPTS)),
            "max_tokens": clients.scalar(400, "int32"),
            "stream": clients.scalar(True, "bool"),
        }
    else:
        inputs = clients.direct_request([5, 6, 7, 8], 400, -1, streaming=True)
    stream = server.grpc_stream()
    try:
        stream.send(model, inputs)
        reply = clients.StreamReply()
        while len(reply.results) < rng.randint(1, 4) and not reply.finished:
            clients.add_event(reply, *stream.next_event(timeout=HANG_S))
    finally:
        stream.close(cancel=True)
    return "cancelled"


def stopped_by_id(server, rng, decoupled) -> str:
    """A long tensorrt_llm request and a `stop` with its id; it must end cancelled (or done, if it won)."""
    request_id = f"soak-{rng.getrandbits(48):x}"
    inputs = clients.direct_request([5, 6, 7, 8], 300, -1, streaming=decoupled)
    client = grpcclient.InferenceServerClient(server.triton.grpc_url)
    ended = threading.Event()
    outcome = {}
    try:
        if decoupled:
            client.start_stream(callback=lambda result, error: _stream_event(outcome, ended, result, error))
            client.async_stream_infer(
                "tensorrt_llm", clients.grpc_inputs(inputs), request_id=request_id, enable_empty_final_response=True
            )
        else:
            client.async_infer(
                "tensorrt_llm",
                clients.grpc_inputs(inputs),
                request_id=request_id,
                callback=lambda result, error: (outcome.update(error=error), ended.set()),
            )
        time.sleep(rng.uniform(0.0, 0.2))
        if decoupled:  # a decoupled model takes requests on streams only
            stop_reply = server.stream_infer("tensorrt_llm", clients.stop_request(), request_id=request_id)
            assert stop_reply.error is None, stop_reply.error
        else:
            client.infer("tensorrt_llm", clients.grpc_inputs(clients.stop_request()), request_id=request_id)
        assert ended.wait(HANG_S), f"request {request_id} never ended after its stop"
    finally:
        if decoupled:
            client.stop_stream()
        client.close()
    error = outcome.get("error")
    assert error is None or "cancelled" in str(error), error
    return "stopped" if error is not None else "finished first"


def _stream_event(outcome, ended, result, error) -> None:
    if error is not None:
        outcome["error"] = error
        ended.set()
        return
    final = result.get_response().parameters.get("triton_final_response")
    if final is not None and final.bool_param:
        ended.set()


KINDS = [(ensemble_text, 5), (cancelled_stream, 2), (stopped_by_id, 1), (bad_input, 2)]


def run_traffic(server, decoupled: bool, count: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    kinds = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS], k=count)
    seeds = [rng.getrandbits(32) for _ in kinds]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(kind, server, random.Random(s), decoupled) for kind, s in zip(kinds, seeds)]
        results = [future.result(timeout=HANG_S * 2) for future in futures]
    return {name: results.count(name) for name in sorted(set(results))}


# ---------------------------------------------------------------------------------------------- reloads


def repository(server, action: str, model: str, parameters: dict | None = None) -> None:
    body = json.dumps({"parameters": parameters or {}}).encode()
    request = urllib.request.Request(
        f"http://{server.triton.http_url}/v2/repository/models/{model}/{action}",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200


def repository_states(server) -> dict[str, str]:
    request = urllib.request.Request(f"http://{server.triton.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return {entry["name"]: entry.get("state", "") for entry in json.loads(response.read())}


def server_rss_bytes(server_pid: int) -> int:
    """Resident memory of tritonserver and its stub processes."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        pid = int(status.parent.name)
        if pid == server_pid or fields.get("PPid", "").strip() == str(server_pid):
            total += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return total


MODELS = ("tensorrt_llm_bls", "ensemble", "preprocessing", "tensorrt_llm", "postprocessing")


def reload_cycle(server) -> None:
    """Every model unloaded (each by name: models loaded by --load-model are nobody's dependents), then loaded."""
    for model in MODELS:
        repository(server, "unload", model)
    deadline = time.monotonic() + HANG_S
    while any(state not in ("UNAVAILABLE", "") for state in repository_states(server).values()):
        assert time.monotonic() < deadline, f"unload did not finish: {repository_states(server)}"
        time.sleep(0.2)
    for model in reversed(MODELS):
        repository(server, "load", model)
    assert all(state == "READY" for state in repository_states(server).values()), repository_states(server)


# ---------------------------------------------------------------------------------------------- the test


def test_mixed_traffic_with_faults_then_reload_cycles(soak_server):
    server, decoupled = soak_server
    started = time.monotonic()
    counts = run_traffic(server, decoupled, SOAK_REQUESTS, seed=20)
    traffic_s = time.monotonic() - started
    after = server.wait_engine_idle(timeout=30)
    assert clients.engine_is_idle(after), f"blocks or requests left after the traffic: {after}"
    rss = []
    for _ in range(SOAK_CYCLES):
        reload_cycle(server)
        assert server.generate({"text_input": "Hello there", "max_tokens": 3, "bad_words": "", "stop_words": ""})[
            "text_output"
        ].startswith("Hello there")
        rss.append(server_rss_bytes(server.triton.process.pid))
    growth = (rss[-1] - rss[0]) / rss[0] if len(rss) > 1 else 0.0
    print(
        f"\n[soak] {'decoupled' if decoupled else 'one-response'}: {SOAK_REQUESTS} requests in "
        f"{traffic_s:.0f}s at concurrency {CONCURRENCY}: {counts}; {SOAK_CYCLES} reload cycles, server "
        f"memory {rss[0] / 2**20:.0f} -> {rss[-1] / 2**20:.0f} MiB ({growth:+.2%})"
    )
    if LONG:
        assert growth < 0.01, f"memory grew {growth:.2%} over {SOAK_CYCLES} reload cycles"
