"""Request lifecycle of the `tensorrt_llm` model: submit rows to the engine, send responses, cancel.

`execute` only converts and submits (it returns at once). Engine outputs arrive through callbacks on the engine's
thread and are queued; one sender thread turns them into Triton responses and, every
`cancellation_check_period_ms`, asks Triton whether any client went away (then aborts its engine requests, which
frees their KV blocks). A `stop=true` request with the same request id aborts them too; one that comes before its
request is held for STOP_HOLD_S and stops the request if it arrives by then. In decoupled mode a request that
asks for `cancel_key` (the ensemble does) gets one in each response: its postprocessing step sends it back
through the `StopChannel` when the ensemble request was cancelled, and the request then ends quietly (a bare final
flag: an error would keep Triton 2.51 from ever completing the ensemble request). When an engine request
finishes, the sender thread hands its final output to `on_finished` (the per-request metrics)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from tritonllm.engine.types import RequestOutput
from tritonllm.triton.guided_inputs import is_guide_error, name_guide_error
from tritonllm.triton.llm_request import EngineRow, convert_request, is_stop_request
from tritonllm.triton.llm_responses import beam_tensors, merge_batch, sequence_tensors
from tritonllm.triton.pb import InputError, error_response, output_tensor, pb_utils, send_final, send_response
from tritonllm.triton.request_metrics import report_finished
from tritonllm.triton.sender_loop import SenderLoop
from tritonllm.triton.stop_channel import StopChannel

log = logging.getLogger("tritonllm.tensorrt_llm")
STOP_HOLD_S = 2.0  # how long a `stop` waits for a request id not seen yet
CANCEL_KEY = "cancel_key"


@dataclass(eq=False)
class TritonRequestState:
    """One Triton request: its rows (one engine request each) and what has been sent."""

    request: object
    sender: object
    triton_id: str
    rows: list[EngineRow]
    engine_ids: list[int] = field(default_factory=list)
    rows_done: int = 0
    sequences_done: set = field(default_factory=set)
    final_rows: dict = field(default_factory=dict)  # non-decoupled: row -> tensors
    cancel_token: str = ""  # set when the request asked for `cancel_key`
    cancel_key: Optional[np.ndarray] = None  # then its `cancel_key` output, built once
    cancelled: bool = False
    quiet: bool = False  # stopped through its cancel key: ends with the final flag alone, no error
    closed: bool = False


class LLMInflightRequests(SenderLoop):
    """`active`: engine request id -> TritonRequestState (one state per row's engine request)."""

    def __init__(
        self,
        engine,
        decoupled: bool,
        exclude_input_in_output: bool,
        cancellation_check_ms: int,
        on_finished: Optional[Callable[[RequestOutput], None]] = None,
    ):
        super().__init__(cancellation_check_ms, "tritonllm-sender")
        self.engine = engine
        self.on_finished = on_finished
        self.decoupled = decoupled
        self.exclude_input_in_output = exclude_input_in_output
        self.by_triton_id: dict[str, list[TritonRequestState]] = {}
        # `stop` for an id no running request has yet (it may be on its way): id -> when the hold ends.
        self.held_stops: dict[str, float] = {}
        self.recently_closed: dict[str, float] = {}  # ids of requests that ended lately -> when that is forgotten
        self.by_cancel_token: dict[str, TritonRequestState] = {}
        self.stop_channel = StopChannel(self._stop_by_token) if decoupled else None
        self.start_sending()

    # -- called from execute() --------------------------------------------------------------------------------

    def submit(self, request) -> None:
        sender = request.get_response_sender()
        try:
            if is_stop_request(request):
                self._stop(request.request_id())
                # One-response mode must send a response; the flag alone is what a stream's end is.
                send_final(sender, None if self.decoupled else pb_utils().InferenceResponse(output_tensors=[]))
                return
            rows = convert_request(request, self.exclude_input_in_output, self.decoupled)
            if not self.decoupled and any(row.params.n > 1 and row.params.beam_width == 1 for row in rows):
                raise InputError("input 'num_return_sequences' > 1 needs decoupled mode (one response per sequence)")
            state = TritonRequestState(request, sender, request.request_id(), rows)
            if self.stop_channel is not None and _asks_for(request, CANCEL_KEY):
                state.cancel_token = self.stop_channel.new_token()
                state.cancel_key = np.array([[self.stop_channel.key(state.cancel_token).encode()]], dtype=object)
            self._start(state)
        except (InputError, ValueError) as exc:
            send_final(sender, error_response(str(exc)))

    def _start(self, state: TritonRequestState) -> None:
        with self.lock:
            try:
                for index, row in enumerate(state.rows):
                    handle = self._submit_row(state, index, row)
                    state.engine_ids.append(handle.request_id)
                    self.active[handle.request_id] = state
            except Exception:
                self._cancel(state)
                for engine_id in state.engine_ids:
                    self.active.pop(engine_id, None)
                raise
            if state.triton_id:
                self.by_triton_id.setdefault(state.triton_id, []).append(state)
            if state.cancel_token:
                self.by_cancel_token[state.cancel_token] = state
            stopped = bool(state.triton_id) and self._take_held_stop(state.triton_id)
        if stopped:
            log.info("request %r arrived after its stop: cancelling it", state.triton_id)
            self._cancel(state)

    def _submit_row(self, state: TritonRequestState, index: int, row: EngineRow):
        try:
            return self.engine.generate_async(
                row.prompt_token_ids,
                row.params,
                streaming=row.options.streaming,
                on_output=lambda _handle, item, s=state, r=index: self.events.put((s, r, item)),
                **({"lora_request": row.lora} if row.lora is not None else {}),
            )
        except ValueError as exc:
            guide = row.params.guided_decoding
            if guide is not None and is_guide_error(exc):
                raise name_guide_error(exc, guide) from None
            raise

    def _stop(self, triton_id: str) -> None:
        if not triton_id:
            raise InputError("input 'stop': a request id must be provided for request cancellation")
        with self.lock:
            states = list(self.by_triton_id.get(triton_id, []))
            self._expire_held_stops()
            # Not here yet: a request with this id arriving soon is stopped. One that just ended (a stop that
            # raced its end) holds nothing, so that the next request reusing the id runs.
            hold = not states and triton_id not in self.recently_closed
            if hold:
                self._remember(self.held_stops, triton_id)
        if hold:
            log.info("stop for request %r, which is not running: held for %.0f s", triton_id, STOP_HOLD_S)
        for state in states:
            self._cancel(state)

    def _stop_by_token(self, token: str) -> None:
        """A postprocessing step of this request saw the ensemble request cancelled (stop channel thread)."""
        with self.lock:
            state = self.by_cancel_token.get(token)
        if state is not None and not state.cancelled:
            log.info("ensemble request %r cancelled by its client: stopping it", state.triton_id)
            state.quiet = True
            self._cancel(state)

    def _take_held_stop(self, triton_id: str) -> bool:
        """Whether a held `stop` awaits this id (under `lock`); it is used up."""
        self._expire_held_stops()
        return self.held_stops.pop(triton_id, None) is not None

    def _expire_held_stops(self) -> None:
        """Drop what is older than STOP_HOLD_S; both tables are in deadline order (see _remember), so this stops
        at the first live entry."""
        now = time.monotonic()
        for table in (self.held_stops, self.recently_closed):
            while table:
                oldest = next(iter(table))
                if table[oldest] >= now:
                    break
                del table[oldest]

    @staticmethod
    def _remember(table: dict[str, float], triton_id: str) -> None:
        table.pop(triton_id, None)  # re-inserted at the end: the table stays in deadline order
        table[triton_id] = time.monotonic() + STOP_HOLD_S

    def _cancel(self, state: TritonRequestState) -> None:
        state.cancelled = True
        for engine_id in state.engine_ids:
            self.engine.abort(engine_id)

    # -- sender thread ----------------------------------------------------------------------------------------

    def _fail(self, event: tuple) -> None:
        log.exception("failed to send a response for request %r", event[0].triton_id)
        self._close(event[0], error_response("internal error while sending the response"))

    def _on_client_gone(self, state: TritonRequestState) -> None:
        log.info("client cancelled request %r: aborting it", state.triton_id)
        self._cancel(state)

    def _on_output(self, state: TritonRequestState, row: int, item) -> None:
        if state.closed:
            return
        if isinstance(item, BaseException):
            self._cancel(state)
            self._close(state, error_response(str(item)))
            return
        if item.finished:
            state.rows_done += 1
            report_finished(self.on_finished, item, log)
        if state.cancelled:
            if state.rows_done == len(state.rows):
                self._close(state, None if state.quiet else error_response("request was cancelled", cancelled=True))
            return
        if self.decoupled:
            self._send_decoupled(state, row, item)
        else:
            self._collect_non_decoupled(state, row, item)

    def _send_decoupled(self, state: TritonRequestState, row: int, output: RequestOutput) -> None:
        options = state.rows[row].options
        batch_index = row if len(state.rows) > 1 else None
        if state.rows[row].params.beam_width > 1:
            pending = [
                beam_tensors(
                    output.prompt_token_ids,
                    output.outputs,
                    options,
                    is_final=output.finished,
                    batch_index=batch_index,
                    streaming=options.streaming,
                )
            ]
        else:
            pending = self._sequence_responses(state, row, output, options, batch_index)
        last_row = state.rows_done == len(state.rows) and output.finished
        if state.cancel_key is not None:
            key = output_tensor(CANCEL_KEY, state.cancel_key)
            pending = [tensors + [key] for tensors in pending]
        for position, tensors in enumerate(pending):
            if last_row and position == len(pending) - 1:
                self._close(state, pb_utils().InferenceResponse(output_tensors=tensors))
            else:
                send_response(state.sender, pb_utils().InferenceResponse(output_tensors=tensors))
        if last_row and not state.closed:
            self._close(state, None)

    def _sequence_responses(
        self, state: TritonRequestState, row: int, output: RequestOutput, options, batch_index: Optional[int]
    ) -> list[list]:
        """One response per sequence that has new tokens or finished (num_return_sequences > 1: several)."""
        pending = []
        for completion in output.outputs:
            key = (row, completion.index)
            if key in state.sequences_done:
                continue
            finished = completion.finish_reason is not None
            if not finished and not completion.token_ids_diff:
                continue
            if finished:
                state.sequences_done.add(key)
            sequence_index = completion.index if len(output.outputs) > 1 else None
            pending.append(
                sequence_tensors(
                    output.prompt_token_ids,
                    completion,
                    options,
                    delta=options.streaming,
                    is_final=finished,
                    batch_index=batch_index,
                    sequence_index=sequence_index,
                    context_logits=output.context_logits,
                )
            )
        return pending

    def _collect_non_decoupled(self, state: TritonRequestState, row: int, output: RequestOutput) -> None:
        if not output.finished:
            return
        options = state.rows[row].options
        if state.rows[row].params.beam_width > 1:
            state.final_rows[row] = beam_tensors(
                output.prompt_token_ids, output.outputs, options, is_final=True, batch_index=None, streaming=False
            )
        else:
            state.final_rows[row] = sequence_tensors(
                output.prompt_token_ids,
                output.outputs[0],
                options,
                delta=False,
                is_final=True,
                batch_index=None,
                sequence_index=None,
                context_logits=output.context_logits,
            )
        if len(state.final_rows) == len(state.rows):
            tensors = merge_batch([state.final_rows[i] for i in range(len(state.rows))])
            self._close(state, pb_utils().InferenceResponse(output_tensors=tensors))

    def _close(self, state: TritonRequestState, response) -> None:
        """Send the request's last response (FINAL flag) and forget it."""
        if state.closed:
            return
        state.closed = True
        send_final(state.sender, response)
        with self.lock:
            for engine_id in state.engine_ids:
                self.active.pop(engine_id, None)
            self.by_cancel_token.pop(state.cancel_token, None)
            if state.triton_id:
                self._expire_held_stops()  # keeps both tables to the last STOP_HOLD_S seconds' ids
                self._remember(self.recently_closed, state.triton_id)
            if state.triton_id in self.by_triton_id:
                remaining = [s for s in self.by_triton_id[state.triton_id] if s is not state]
                if remaining:
                    self.by_triton_id[state.triton_id] = remaining
                else:
                    del self.by_triton_id[state.triton_id]

    def shutdown(self, timeout: float = 3.0) -> None:
        """Abort what is still running, let the sender answer it, then stop. Bounded well under tritonserver's
        exit timeout: a model still finalizing then would be left behind as an orphaned stub process."""
        for state in self.live_states():
            self._cancel(state)
        self.stop_sending(timeout)
        if self.stop_channel is not None:
            self.stop_channel.close()
        if self.thread.is_alive():
            log.warning(
                "%d request(s) still unanswered at shutdown: %s",
                len(self.active),
                sorted({s.triton_id for s in self.active.values()}),
            )


def _asks_for(request, output: str) -> bool:
    names = getattr(request, "requested_output_names", None)
    return names is not None and output in names()
