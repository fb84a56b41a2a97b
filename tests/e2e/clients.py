"""Small clients for the e2e tests: HTTP generate / generate_stream (stdlib http.client, so a test can drop a
connection mid-stream), gRPC streams (tritonclient), and the tensorrt_llm gauges on the metrics endpoint.

conftest.py loads this file as the module `e2e_clients` (the tests folder is not on sys.path)."""

from __future__ import annotations

import http.client
import json
import queue
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tritonllm.deploy.tritonserver import Ports, TritonServer


class ServerReplyError(AssertionError):
    """The server answered with an error where the test expected a result."""


@dataclass
class StreamReply:
    """What one request on a gRPC stream got back: its results, and the error that ended it, if any."""

    results: list = field(default_factory=list)
    error: Optional[str] = None
    finished: bool = False  # a final response (or an error) arrived

    def outputs(self, name: str) -> list[np.ndarray]:
        return [r.as_numpy(name) for r in self.results if r.as_numpy(name) is not None]

    def texts(self) -> list[str]:
        return [text for array in self.outputs("text_output") for text in decode_texts(array)]


class GrpcStream:
    """One gRPC client with its bidirectional stream; every response (or error) lands in `events`."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def send(self, model: str, inputs: dict[str, np.ndarray], request_id: str = "") -> None:
        self.client.async_stream_infer(
            model, grpc_inputs(inputs), request_id=request_id, enable_empty_final_response=True
        )

    def next_event(self, timeout: float) -> tuple[Any, Optional[InferenceServerException]]:
        return self.events.get(timeout=timeout)

    def collect(self, reply: Optional[StreamReply] = None, timeout: float = 60) -> StreamReply:
        """Read until the request's final response or an error (one request in flight on this stream)."""
        reply = reply or StreamReply()
        deadline = time.monotonic() + timeout
        while not reply.finished:
            try:
                result, error = self.next_event(max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no final response within {timeout}s ({len(reply.results)} received)") from None
            add_event(reply, result, error)
        return reply

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def add_event(reply: StreamReply, result, error) -> None:
    if error is not None:
        reply.error, reply.finished = str(error), True
        return
    response = result.get_response()
    final = response.parameters.get("triton_final_response")
    if response.outputs:
        reply.results.append(result)
    if final is not None and final.bool_param:
        reply.finished = True


def grpc_inputs(inputs: dict[str, np.ndarray]) -> list:
    tensors = []
    for name, array in inputs.items():
        array = np.asarray(array)
        if array.dtype.kind in "OSU":
            array = np.vectorize(lambda s: s.encode() if isinstance(s, str) else s, otypes=[object])(array)
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def decode_texts(array: np.ndarray) -> list[str]:
    return [value.decode("utf-8") if isinstance(value, bytes) else str(value) for value in array.reshape(-1)]


def scalar(value, dtype) -> np.ndarray:
    """A [1, 1] tensor: one batch row of a dims [1] input."""
    return np.array([[value]], dtype=dtype)


def strings(*values: str) -> np.ndarray:
    """A [1, N] STRING tensor."""
    return np.array([list(values)], dtype=object)


@dataclass
class LiveServer:
    triton: TritonServer
    log_file: Path
    max_seq_len: int
    probe_model: str = "ensemble"  # what `still_serves` asks for two tokens
    broken: Optional[str] = None  # set once the server stopped serving: later tests fail at once, saying why

    def still_serves(self, timeout: float = 30) -> Optional[str]:
        """None when the server is alive, ready and generates two tokens within `timeout`; else what is wrong."""
        code = self.triton.started_process.poll()
        if code is not None:
            return f"tritonserver exited with code {code}"
        if not self.triton.is_ready():
            return "tritonserver is running but /v2/health/ready does not answer 200"
        try:
            status, data = self.post(
                f"/v2/models/{self.probe_model}/generate", {"text_input": "Hi", "max_tokens": 2}, timeout=timeout
            )
        except (OSError, http.client.HTTPException) as error:
            return f"a two-token request to {self.probe_model} got no answer within {timeout}s ({error!r})"
        if status != 200:
            return f"a two-token request to {self.probe_model} failed: HTTP {status}: {data[:300]!r}"
        return None

    @property
    def ports(self) -> Ports:
        return self.triton.ports

    # -- HTTP generate extension (stdlib http.client, so a test can also drop a connection mid-stream) ------

    def connection(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("localhost", self.ports.http, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
        connection = self.connection(timeout)
        try:
            connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def generate(self, body: dict, model: str = "ensemble") -> dict:
        """POST /generate; the answer's JSON, or ServerReplyError when the server answers with an error."""
        status, data = self.post(f"/v2/models/{model}/generate", body)
        reply = json.loads(data)
        if status != 200 or "error" in reply:
            raise ServerReplyError(f"HTTP {status}: {reply.get('error', reply)}")
        return reply

    def generate_error(self, body: dict, model: str = "ensemble") -> tuple[int, str]:
        """POST /generate for a request that must fail: (HTTP status, error message)."""
        status, data = self.post(f"/v2/models/{model}/generate", body)
        reply = json.loads(data)
        assert "error" in reply, f"expected an error, got HTTP {status}: {reply}"
        return status, reply["error"]

    def generate_stream(self, body: dict, model: str = "ensemble") -> list[dict]:
        """POST /generate_stream; every SSE event's JSON. An event carrying an error raises ServerReplyError."""
        connection = self.connection()
        try:
            connection.request(
                "POST", f"/v2/models/{model}/generate_stream", json.dumps(body), {"Content-Type": "application/json"}
            )
            events = list(sse_events(connection.getresponse()))
        finally:
            connection.close()
        for event in events:
            if "error" in event:
                raise ServerReplyError(f"stream error: {event['error']}")
        return events

    # -- gRPC --------------------------------------------------------------------------------------------------

    def grpc_stream(self) -> GrpcStream:
        return GrpcStream(self.triton.grpc_url)

    def stream_infer(
        self, model: str, inputs: dict[str, np.ndarray], request_id: str = "", timeout: float = 60
    ) -> StreamReply:
        stream = self.grpc_stream()
        try:
            stream.send(model, inputs, request_id)
            return stream.collect(timeout=timeout)
        finally:
            stream.close()

    # -- metrics -----------------------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        """GET /metrics on the metrics port: Prometheus text, as curl shows it."""
        connection = http.client.HTTPConnection("localhost", self.ports.metrics, timeout=10)
        try:
            connection.request("GET", "/metrics")
            return connection.getresponse().read().decode()
        finally:
            connection.close()

    def metrics(self) -> dict[tuple[str, str], float]:
        """The tensorrt_llm gauges: (family, kind label value) -> value."""
        return parse_trt_llm_gauges(self.metrics_text())

    def wait_engine_idle(self, timeout: float = 10) -> dict[tuple[str, str], float]:
        """Poll the metrics until no request is active and every KV block is free, in a sample taken after this
        call began (the gauges refresh every stats_check_period_ms); returns the last sample."""
        since_us = time.time() * 1e6  # the timestamp gauge counts microseconds since the epoch
        deadline = time.monotonic() + timeout
        while True:
            sample = self.metrics()
            fresh = sample.get(("nv_trt_llm_general_metrics", "timestamp"), 0) > since_us
            if (fresh and engine_is_idle(sample)) or time.monotonic() > deadline:
                return sample
            time.sleep(0.05)


_GAUGE_LINE = re.compile(r"^(nv_trt_llm_\w+)\{([^}]*)\}\s+(\S+)$")
_KIND_LABELS = (
    "request_type",
    "kv_cache_block_type",
    "general_type",
    "memory_type",
    "inflight_batcher_specific_metric",
)


def parse_trt_llm_gauges(text: str) -> dict[tuple[str, str], float]:
    gauges = {}
    for line in text.splitlines():
        match = _GAUGE_LINE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if labels.get("model") != "tensorrt_llm":
            continue
        kind = next((labels[name] for name in _KIND_LABELS if name in labels), None)
        if kind is not None:
            gauges[(match.group(1), kind)] = float(match.group(3))
    return gauges


@dataclass(frozen=True)
class Sample:
    """One line of Prometheus text: `name{labels} value`."""

    name: str
    labels: dict
    value: float


_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$")


def parse_samples(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples.append(Sample(match.group(1), labels, float(match.group(3))))
    return samples


def engine_is_idle(gauges: dict[tuple[str, str], float]) -> bool:
    kv = "nv_trt_llm_kv_cache_block_metrics"
    return (
        gauges.get(("nv_trt_llm_request_metrics", "active")) == 0
        and gauges.get((kv, "used")) == 0
        and gauges.get((kv, "free")) == gauges.get((kv, "max"))
    )


ITERATIONS = ("nv_trt_llm_general_metrics", "iteration_counter")


def assert_cut_short(server: "LiveServer", before: dict[tuple[str, str], float], max_tokens: int) -> None:
    """A stream its client cancelled freed the engine and ended before its `max_tokens` steps (a request that ran
    to its end takes at least that many). The bound is the request's length, not a number of steps: how many steps
    run before the cancellation lands depends on the machine (it crosses polls every cancellation_check_period_ms,
    the OpenAI front, busy cores), and one loaded CI machine ran 1027 of a 2042-token request's steps."""
    after = server.wait_engine_idle(timeout=10)
    assert engine_is_idle(after), f"the engine did not free its blocks or requests: {after}"
    steps = after[ITERATIONS] - before[ITERATIONS]
    assert 0 < steps < max_tokens, f"the engine ran {steps} steps of a cancelled {max_tokens}-token request"


def sse_events(response: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON payloads of a server-sent-event stream, as they arrive."""
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            yield json.loads(line[len("data:") :])


# ---------------------------------------------------------------------------------------------- references


def direct_request(prompt_ids: list[int], max_tokens: int, end_id: int, **extra) -> dict[str, np.ndarray]:
    """Inputs of a one-row `tensorrt_llm` request (token ids in, as the contract's direct clients send)."""
    inputs = {
        "input_ids": np.array([prompt_ids], dtype=np.int32),
        "input_lengths": scalar(len(prompt_ids), np.int32),
        "request_output_len": scalar(max_tokens, np.int32),
        "end_id": scalar(end_id, np.int32),
        "pad_id": scalar(end_id, np.int32),
    }
    for name, value in extra.items():
        inputs[name] = value if isinstance(value, np.ndarray) else scalar(value, PYTHON_DTYPES[type(value)])
    return inputs


PYTHON_DTYPES = {bool: np.bool_, int: np.int32, float: np.float32}


def stop_request() -> dict[str, np.ndarray]:
    """A `stop=true` request, as TensorRT-LLM's inflight_batcher_llm_client sends it (same request id as the
    request to stop)."""
    return {
        "input_ids": scalar(0, np.int32),
        "input_lengths": scalar(0, np.int32),
        "request_output_len": scalar(0, np.int32),
        "stop": scalar(True, np.bool_),
    }


def generate_body(inputs: dict[str, np.ndarray]) -> dict:
    """One-row tensor inputs as a /generate JSON body: token lists stay lists, one-value tensors become numbers."""
    return {
        name: array.reshape(-1).tolist() if array.size > 1 or name == "input_ids" else array.reshape(-1)[0].item()
        for name, array in inputs.items()
    }


def greedy_token_ids(server: "LiveServer", prompt_ids: list[int], max_tokens: int, end_id: int) -> list[int]:
    """The generated ids of a greedy direct `tensorrt_llm` request (prompt excluded)."""
    reply = server.stream_infer(
        "tensorrt_llm", direct_request(prompt_ids, max_tokens, end_id, exclude_input_in_output=True)
    )
    if reply.error:
        raise ServerReplyError(reply.error)
    (output_ids,) = reply.outputs("output_ids")
    return output_ids.reshape(-1).tolist()


def first_word_position(tokenizer, ids: list[int], start: int = 1, min_letters: int = 3) -> int:
    """The first position >= start whose token is a whole word (" " + letters) that the tokenizer encodes back to
    that one token and that does not occur earlier: a stop word, bad word or end id that cuts the output there."""
    for position in range(start, len(ids)):
        text = tokenizer.decode([ids[position]])
        word = text[1:]
        if (
            text.startswith(" ")
            and word.isascii()
            and word.isalpha()
            and len(word) >= min_letters
            and tokenizer.encode(text, add_special_tokens=False) == [ids[position]]
            and ids[position] not in ids[:position]
        ):
            return position
    raise AssertionError(f"no usable word token in {ids}: pick another prompt")
