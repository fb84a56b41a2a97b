"""Request lifecycle of the LLM-API `tensorrt_llm` model: tokenize, run the engine, detokenize, respond, cancel.

`submit` (called from execute) converts a request and starts one engine request; it returns at once. The engine
always streams its updates here, whatever the client asked for, so stop strings are found in the text as it grows.
Updates are queued to one sender thread, which keeps each sequence's text (SequenceText) and answers: every update
that changes the text when the client streams, one response at the end otherwise. Every
`cancellation_check_period_ms` it asks Triton whether a client went away and then aborts the engine request, which
frees its KV blocks (TensorRT-LLM's llmapi model never does: contract 1.3); the client gets a CANCELLED error.
A `stop=true` request naming a running request's id (TensorRT-LLM's llmapi `stop`) aborts it the same way, but the
stopped request ends as TensorRT-LLM's does: a last, normal response with the text so far and finish_reason
"cancelled" (streaming or not); the stop request itself is answered CANCELLED "Request cancelled by client". When
every sequence's text has reached a stop string the engine request is aborted too: the answer is complete."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from tritonllm.engine.types import CompletionOutput, InvalidRequestError, RequestOutput
from tritonllm.triton.llm_request import is_stop_request
from tritonllm.triton.llmapi_request import LLMAPIRequest, convert_request, name_inputs
from tritonllm.triton.llmapi_responses import (
    PerfOutputs,
    SequenceResult,
    error_response,
    inference_response,
    perf_outputs,
)
from tritonllm.triton.llmapi_text import SequenceText
from tritonllm.triton.pb import InputError, send_final, send_response
from tritonllm.triton.request_metrics import report_finished
from tritonllm.triton.sender_loop import SenderLoop

log = logging.getLogger("tritonllm.llmapi")


@dataclass(eq=False)
class RequestState:
    sender: Any
    job: LLMAPIRequest
    triton_id: str = ""  # the client's request id, which a `stop` request names
    texts: dict[int, SequenceText] = field(default_factory=dict)  # sequence index -> its text
    engine_id: Optional[int] = None
    last_sent: Optional[list[str]] = None  # texts of the last streamed response
    cancelled: bool = False
    closed: bool = False


class LLMAPIInflightRequests(SenderLoop):
    """`active`: engine request id -> RequestState."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        decoupled: bool,
        cancellation_check_ms: int = 100,
        on_finished: Optional[Callable[[RequestOutput], None]] = None,
        batched: bool = False,
    ):
        """`batched`: the model has max_batch_size > 0, so inputs and outputs carry a batch dimension (of 1)."""
        super().__init__(cancellation_check_ms, "tritonllm-llmapi-sender")
        self.engine = engine
        self.tokenizer = tokenizer
        self.decoupled = decoupled
        self.batched = batched
        self.on_finished = on_finished
        self.by_triton_id: dict[str, list[RequestState]] = {}
        self.tokens_per_block = engine.stats().tokens_per_block  # for the kv_cache_missed_block output
        self.start_sending()

    # -- called from execute() --------------------------------------------------------------------------------

    def submit(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            if is_stop_request(request):
                self._stop(request.request_id(), sender)
                return
            job = convert_request(request, self.tokenizer, self.decoupled, self.batched)
            self._start(RequestState(sender, job, request.request_id() or ""))
        except InvalidRequestError as exc:  # the engine refused it; say which inputs are concerned
            send_final(sender, self._error(name_inputs(str(exc))))
        except (InputError, ValueError) as exc:
            send_final(sender, self._error(str(exc)))

    def _start(self, state: RequestState) -> None:
        with self.lock:  # the sender thread forgets a request under this lock: it must be registered first
            handle = self.engine.generate_async(
                state.job.prompt_token_ids,
                state.job.params,
                streaming=True,
                on_output=lambda _handle, item: self.events.put((state, item)),
                lora_request=state.job.lora,
            )
            state.engine_id = handle.request_id
            self.active[handle.request_id] = state
            if state.triton_id:
                self.by_triton_id.setdefault(state.triton_id, []).append(state)

    def _stop(self, triton_id: str, sender: Any) -> None:
        """TensorRT-LLM's llmapi `stop`: abort the running requests with this id (each then answers its text so far,
        finish_reason "cancelled"); the stop request is answered CANCELLED "Request cancelled by client", as there.
        An id that names no running request is answered NOT_FOUND and touches nothing (TensorRT-LLM answers
        CANCELLED either way, which hides a stop that came too late or named the wrong id)."""
        if not triton_id:
            raise InputError("input 'stop': a request id must be provided for request cancellation")
        with self.lock:
            states = [state for state in self.by_triton_id.get(triton_id, []) if not state.closed]
        if not states:
            message = f"input 'stop': no running request has the id {triton_id!r}; nothing was stopped"
            send_final(sender, self._error(message, "NOT_FOUND"))
            return
        for state in states:
            log.info("stop request for %r: aborting engine request %s", triton_id, state.engine_id)
            self.engine.abort(state.engine_id)  # its final output (finish_reason "cancelled") closes it
        send_final(sender, self._error("Request cancelled by client", "CANCELLED"))

    def _error(self, message: str, code_name: str = "INVALID_ARG") -> Any:
        return error_response(message, code_name, batch_dim=self.batched)

    # -- sender thread ----------------------------------------------------------------------------------------

    def _fail(self, event: tuple) -> None:
        log.exception("failed to answer an LLM-API request")
        self._close(event[0], self._error("internal error while sending the response", "INTERNAL"))

    def _on_client_gone(self, state: RequestState) -> None:
        log.info("client cancelled an LLM-API request: aborting engine request %s", state.engine_id)
        state.cancelled = True
        self.engine.abort(state.engine_id)

    def _on_output(self, state: RequestState, item: Any) -> None:
        if isinstance(item, BaseException):
            self._close(state, self._error(f"the engine failed: {item}", "INTERNAL"))
            return
        if item.finished:
            report_finished(self.on_finished, item, log)
        if state.closed:
            return  # answered already (every sequence reached a stop string); only the metrics were left
        if state.cancelled:
            if item.finished:
                self._close(state, self._error("request was cancelled", "CANCELLED"))
            return
        if self._update_texts(state, item):
            if not item.finished:
                self.engine.abort(state.engine_id)  # every text is complete: stop generating
            self._close(state, inference_response(self._final_results(state, item), state.job.outputs))
        elif state.job.streaming:
            self._send_progress(state, item)

    def _update_texts(self, state: RequestState, output: RequestOutput) -> bool:
        """Decode what each sequence added; True once every sequence has finished or reached a stop string."""
        for completion in output.outputs:
            text = state.texts.setdefault(completion.index, SequenceText(self.tokenizer, state.job.stop))
            text.add(completion.token_ids, is_final=completion.finish_reason is not None)
        return all(c.finish_reason is not None or state.texts[c.index].stopped for c in output.outputs)

    def _send_progress(self, state: RequestState, output: RequestOutput) -> None:
        results = [self._result(state, completion, final=False) for completion in output.outputs]
        texts = [result.text for result in results]
        if texts != state.last_sent:  # a held-back character or stop-string prefix adds nothing to send
            state.last_sent = texts
            send_response(state.sender, inference_response(results, state.job.outputs))

    def _final_results(self, state: RequestState, output: RequestOutput) -> list[SequenceResult]:
        results = [self._result(state, completion, final=True) for completion in output.outputs]
        if state.job.best_of > 1:
            results = [max(results, key=lambda result: result.cumulative_logprob)]
        if not state.job.streaming and not state.job.exclude_input:
            results = [replace(result, text=state.job.prompt + result.text) for result in results]
        return results

    def _result(self, state: RequestState, completion: CompletionOutput, final: bool) -> SequenceResult:
        text = state.texts[completion.index]
        perf = self._perf(state, completion)
        if not final:
            return SequenceResult(text.text(final=False), cumulative_logprob=completion.cumulative_logprob, perf=perf)
        finish_reason = "stop" if text.stopped else completion.finish_reason
        return SequenceResult(
            text.text(final=True), finish_reason, text.stopped_by, completion.cumulative_logprob, perf=perf
        )

    def _perf(self, state: RequestState, completion: CompletionOutput) -> Optional[PerfOutputs]:
        metrics = completion.request_perf_metrics
        if not state.job.outputs.perf_metrics or metrics is None:
            return None
        return perf_outputs(metrics, len(state.job.prompt_token_ids), self.tokens_per_block)

    def _close(self, state: RequestState, response: Any) -> None:
        """Send the request's last response (FINAL flag) and forget it."""
        if state.closed:
            return
        state.closed = True
        with self.lock:  # forget it first: a sender that fails must not leave it active forever
            if state.engine_id is not None:  # None: never started
                self.active.pop(state.engine_id, None)
            others = [s for s in self.by_triton_id.pop(state.triton_id, []) if s is not state]
            if others:
                self.by_triton_id[state.triton_id] = others
        send_final(state.sender, response)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is still running, let the sender answer it, then stop."""
        for state in self.live_states():
            state.cancelled = True
            self.engine.abort(state.engine_id)
        self.stop_sending(timeout)
