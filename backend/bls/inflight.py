"""The BLS requests of one model instance: each runs on its own thread (so one instance serves many streams at
once, where TensorRT-LLM's BLS serves one per instance), and one watcher thread asks Triton every
`cancellation_check_period_ms` whether their clients went away."""

from __future__ import annotations

import logging
import threading
from typing import Any

from tritonllm.bls.handler import BlsHandler
from tritonllm.bls.request import read_request
from tritonllm.triton.pb import InputError, error_response, send_final

log = logging.getLogger("tritonllm.tensorrt_llm_bls")


class BlsInflightRequests:
    def __init__(self, transport, decoupled: bool, accumulate: bool, cancellation_check_ms: int, draft_transport=None):
        self.transport = transport
        self.draft_transport = draft_transport  # the draft model of the draft/target loop, if configured
        self.decoupled = decoupled
        self.accumulate = accumulate
        self.period = max(cancellation_check_ms, 1) / 1000
        self.handlers: dict[BlsHandler, threading.Thread] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="tritonllm-bls-cancellation", daemon=True)
        self.watcher.start()

    def submit(self, request: Any) -> None:
        """Called in execute: reads the request there (its memory may be released once execute returns), then
        runs it on a thread of its own."""
        sender = request.get_response_sender()
        try:
            bls = read_request(request, self.decoupled)
            if bls.speculation is not None and self.draft_transport is None:
                raise InputError(
                    "num_draft_tokens",
                    "> 0 needs a draft model: set the tensorrt_llm_draft_model_name "
                    "parameter of tensorrt_llm_bls (tritonllm repo build --draft-model DIR)",
                )
        except ValueError as error:  # InputError among them
            send_final(sender, error_response(error))
            return
        handler = BlsHandler(bls, sender, self.transport, self.accumulate, self.draft_transport)
        thread = threading.Thread(target=self._run, args=(handler,), name="tritonllm-bls-request", daemon=True)
        with self.lock:
            self.handlers[handler] = thread
        thread.start()

    def _run(self, handler: BlsHandler) -> None:
        try:
            handler.run()
        finally:
            with self.lock:
                self.handlers.pop(handler, None)

    def _watch(self) -> None:
        while not self.stopping.wait(self.period):
            for handler in self._snapshot():
                handler.poll_cancelled()

    def _snapshot(self) -> list[BlsHandler]:
        with self.lock:
            return list(self.handlers)

    @property
    def num_active(self) -> int:
        return len(self.handlers)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel what still runs and wait (bounded) for the request threads to answer."""
        self.stopping.set()
        for handler in self._snapshot():
            handler.cancel()
        with self.lock:
            threads = list(self.handlers.values())
        for thread in threads:
            thread.join(timeout / max(len(threads), 1))
        self.transport.close()
        if self.draft_transport is not None:
            self.draft_transport.close()
