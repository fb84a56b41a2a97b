"""Streaming through tensorrt_llm_bls under concurrency: 3 clients x 150 streams of 32 tokens over HTTP
generate_stream, then the same over gRPC streams, while a fourth client keeps opening streams and dropping them
after a few pieces. Every full stream must complete with the right text, the engine must end with every KV block
free, and the BLS must still answer afterwards.

Load of this kind (concurrent streams, clients cancelling) is what crashes Triton 2.51 under a BLS that reads
tensorrt_llm through a BLS exec(decoupled=True) iterator: SIGSEGV in the Python backend, the whole server gone,
after wrong text reached some clients (3 runs of 3 here; environment.md saw the stub die and "Stub process is not
healthy" instead). The same load found a race in this BLS's first version: is_cancelled() asked about a request
whose final response had gone out (1 crash in 4 runs). The BLS calls tensorrt_llm over gRPC and never asks about a
finished request; this test is what says that it survives. (This BLS with the iterator instead of gRPC fails it:
the server died after 173 HTTP streams.)"""

from __future__ import annotations

import json
import threading
import time

import e2e_clients as clients
import numpy as np
import pytest
from e2e_clients import scalar, strings

pytestmark = [pytest.mark.server, pytest.mark.slow]

BLS = "tensorrt_llm_bls"
CLIENTS = 3
STREAMS_PER_CLIENT = 150
TOKENS = 32
DROPPED_TOKENS = 400  # a dropped stream would run this long if its cancellation got lost
PROMPTS = ["Hello there", "The lamp turned and turned", "静かな海の上で、", "Où est la gare ?"]


@pytest.fixture(scope="module")
def expected(server) -> dict[str, str]:
    return {
        prompt: server.generate(
            {"text_input": prompt, "max_tokens": TOKENS, "exclude_input_in_output": True}, model="ensemble"
        )["text_output"]
        for prompt in PROMPTS
    }


def http_stream(server, prompt: str) -> str:
    events = server.generate_stream(
        {"text_input": prompt, "max_tokens": TOKENS, "stream": True, "exclude_input_in_output": True}, model=BLS
    )
    return "".join(event["text_output"] for event in events)


def grpc_stream(stream: clients.GrpcStream, prompt: str) -> str:
    stream.send(
        BLS,
        {
            "text_input": strings(prompt),
            "max_tokens": scalar(TOKENS, np.int32),
            "stream": scalar(True, bool),
            "exclude_input_in_output": scalar(True, bool),
        },
    )
    reply = stream.collect(timeout=120)
    if reply.error:
        raise clients.ServerReplyError(reply.error)
    return "".join(reply.texts())


def http_stream_dropped(server, prompt: str) -> None:
    """Open a long stream, read three pieces, close the connection (Triton cancels the request)."""
    connection = server.connection()
    try:
        connection.request(
            "POST",
            f"/v2/models/{BLS}/generate_stream",
            json.dumps({"text_input": prompt, "max_tokens": DROPPED_TOKENS, "stream": True}),
            {"Content-Type": "application/json"},
        )
        events = clients.sse_events(connection.getresponse())
        for _ in range(3):
            assert "text_output" in next(events)
    finally:
        connection.close()


def grpc_stream_dropped(server, prompt: str) -> None:
    """Open a long stream, read three pieces, cancel it."""
    stream = server.grpc_stream()
    try:
        stream.send(
            BLS,
            {
                "text_input": strings(prompt),
                "max_tokens": scalar(DROPPED_TOKENS, np.int32),
                "stream": scalar(True, bool),
            },
        )
        reply = clients.StreamReply()
        while len(reply.results) < 3:
            clients.add_event(reply, *stream.next_event(timeout=60))
            assert reply.error is None, reply.error
    finally:
        stream.close(cancel=True)


class Load:
    """CLIENTS threads running `one_client(index, record)` and one thread calling `drop_one(prompt)` until they
    are done; what they got right and what went wrong."""

    def __init__(self, one_client, drop_one):
        self.one_client, self.drop_one = one_client, drop_one
        self.right, self.dropped, self.problems = 0, 0, []
        self.lock = threading.Lock()
        self.done = threading.Event()

    def run(self) -> "Load":
        start = time.monotonic()
        workers = [threading.Thread(target=self._client, args=(index,)) for index in range(CLIENTS)]
        dropper = threading.Thread(target=self._dropper)
        for thread in (*workers, dropper):
            thread.start()
        for thread in workers:
            thread.join()
        self.done.set()
        dropper.join()
        self.seconds = time.monotonic() - start
        return self

    def record(self, prompt: str, text: str, expected_text: str) -> None:
        with self.lock:
            if text == expected_text:
                self.right += 1
            else:
                self.problems.append(f"{prompt!r}: got {text[:60]!r}, expected {expected_text[:60]!r}")

    def _client(self, index: int) -> None:
        try:
            self.one_client(index, self.record)
        except Exception as error:  # a stream that failed outright: keep what the others did
            self._problem(f"client {index}: {type(error).__name__}: {str(error)[:300]}")

    def _dropper(self) -> None:
        try:
            while not self.done.is_set():
                self.drop_one(PROMPTS[self.dropped % len(PROMPTS)])
                self.dropped += 1
        except Exception as error:
            self._problem(f"dropping client, after {self.dropped}: {type(error).__name__}: {str(error)[:300]}")

    def _problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


def assert_survived(server, load: Load, transport: str) -> None:
    total = CLIENTS * STREAMS_PER_CLIENT
    assert not load.problems and load.right == total, (
        f"{transport}: {load.right}/{total} streams right in {load.seconds:.0f}s; first problems: {load.problems[:3]}"
    )
    assert load.dropped > 0, "the dropping client never got to drop a stream"
    answer = server.generate({"text_input": PROMPTS[0], "max_tokens": 4}, model=BLS)["text_output"]
    assert answer.startswith(PROMPTS[0]), "the BLS stopped answering after the streams"
    assert "is not healthy" not in server.log_file.read_text(errors="replace")
    gauges = server.wait_engine_idle(timeout=30)
    assert clients.engine_is_idle(gauges), f"dropped streams left engine requests or KV blocks behind: {gauges}"


def test_concurrent_http_streams_all_complete(server, expected):
    def one_client(index, record):
        for number in range(STREAMS_PER_CLIENT):
            prompt = PROMPTS[(index + number) % len(PROMPTS)]
            record(prompt, http_stream(server, prompt), expected[prompt])

    load = Load(one_client, lambda prompt: http_stream_dropped(server, prompt)).run()
    assert_survived(server, load, "HTTP generate_stream")


def test_concurrent_grpc_streams_all_complete(server, expected):
    def one_client(index, record):
        stream = server.grpc_stream()
        try:
            for number in range(STREAMS_PER_CLIENT):
                prompt = PROMPTS[(index + number) % len(PROMPTS)]
                record(prompt, grpc_stream(stream, prompt), expected[prompt])
        finally:
            stream.close()

    load = Load(one_client, lambda prompt: grpc_stream_dropped(server, prompt)).run()
    assert_survived(server, load, "gRPC streams")
