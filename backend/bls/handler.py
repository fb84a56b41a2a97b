"""Runs one BLS request on its own thread: preprocessing, the tensorrt_llm call, postprocessing per response,
stop words, and the responses to the client (the last one with the FINAL flag)."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Optional

import numpy as np

from ..triton.pb import error_response, output_tensor, pb_utils, send_final, send_response, string_tensor
from .inner_models import InnerModelError, postprocess, preprocess
from .llm_calls import LlmCall, LlmCancelled, LlmResponse
from .request import BlsRequest
from .sequences import SequenceText
from .speculative import SpeculativeCall

log = logging.getLogger("tritonllm.tensorrt_llm_bls")

# tensorrt_llm outputs a BLS response carries on as they are.
PASSED_ON = (
    "cum_log_probs",
    "output_log_probs",
    "context_logits",
    "generation_logits",
    "batch_index",
    "sequence_index",
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)


class BlsHandler:
    """One request, read and checked already (`read_request`, in execute: Triton may release the request's
    memory once execute returns, so the handler keeps copies and never touches the request again)."""

    def __init__(self, bls: BlsRequest, sender: Any, transport, accumulate: bool, draft_transport=None):
        self.bls = bls
        self.sender = sender
        self.transport = transport
        self.draft_transport = draft_transport
        self.accumulate = accumulate
        self.request_id = f"bls-{uuid.uuid4()}"  # the tensorrt_llm request's id, for stop requests and logs
        self.lock = threading.Lock()
        # Held around is_cancelled() and the final send: asking Triton about a request whose final response
        # is sent crashes the server (TRITONBACKEND_ResponseFactoryIsCancelled on a freed response factory).
        self.sender_lock = threading.Lock()
        self.call: Optional[LlmCall] = None
        self.cancelled = False  # by the client, or by shutdown
        self.closed = False  # the FINAL flag is sent
        self.sequences: dict[tuple[int, int], SequenceText] = {}

    # -- the request's thread ----------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._generate()
        except InnerModelError as error:
            self._close(error_response(ValueError(str(error)) if error.is_input_error else str(error)))
        except LlmCancelled:
            self._close(error_response("request was cancelled", cancelled=True))
        except Exception as error:  # a bug: answer the request, keep the model serving
            log.exception("request %s failed", self.request_id)
            self._close(error_response(f"tensorrt_llm_bls failed: {type(error).__name__}: {error}"))

    def _generate(self) -> None:
        bls = self.bls
        preprocessed = preprocess(bls.preprocessing_inputs(), self.request_id)
        with self.lock:
            if self.cancelled:
                raise LlmCancelled()
            call = self.call = self._start(bls, bls.llm_inputs(preprocessed))
        for response in call.responses():
            tensors = self._tensors(bls, response)
            done = len(self.sequences) == bls.sequence_count and all(s.finished for s in self.sequences.values())
            if done:
                self._close(pb_utils().InferenceResponse(output_tensors=tensors) if tensors else None)
                if not response.final:
                    call.cancel()  # a stop word ended every sequence: free the engine's work
                return
            if tensors:
                send_response(self.sender, pb_utils().InferenceResponse(output_tensors=tensors))
        self._close(None)  # tensorrt_llm ended without marking every sequence final

    def _start(self, bls: BlsRequest, inputs: dict) -> LlmCall:
        if bls.speculation is None:
            return self.transport.start(inputs, self.request_id)
        return SpeculativeCall(
            self.transport,
            self.draft_transport,
            inputs,
            bls.speculation,
            bls.streaming,
            echo_prompt=not bls.exclude_input[0],
            request_id=self.request_id,
        )

    def _tensors(self, bls: BlsRequest, response: LlmResponse) -> Optional[list]:
        """The BLS response for a tensorrt_llm response: its rows' text (rows of finished sequences left out) and
        the outputs passed on; None when no row is left."""
        outputs = response.outputs
        if "output_ids" not in outputs:
            return None  # a final flag without outputs
        texts = postprocess(outputs, self.request_id)
        beams = outputs["output_ids"].shape[1] if outputs["output_ids"].ndim == 3 else 1
        rows, row_texts = [], []
        for row, key in enumerate(_row_keys(outputs)):
            sequence = self._sequence(bls, key)
            if sequence.finished:
                continue  # a stop word ended it: later tokens are not part of its text
            final = _row_flag(outputs, "detok_is_final", row, default=response.final)
            rows.append(row)
            if beams > 1:  # one text per beam, row after row, as the anchor flattens them
                row_texts += sequence.add_beams(texts[row * beams : (row + 1) * beams], final)
            else:
                row_texts.append(
                    sequence.add_delta(texts[row], final) if bls.streaming else sequence.add_whole(texts[row], final)
                )
        if not rows:
            return None
        tensors = [string_tensor("text_output", row_texts)]
        tensors += [output_tensor(name, outputs[name][rows]) for name in PASSED_ON if name in outputs]
        return tensors

    def _sequence(self, bls: BlsRequest, key: tuple[int, int]) -> SequenceText:
        if key not in self.sequences:
            row = key[0]
            echoed = not bls.streaming and not bls.exclude_input[row]
            self.sequences[key] = SequenceText(
                bls.stop_words[row], self.accumulate, generation_start=len(bls.prompts[row]) if echoed else 0
            )
        return self.sequences[key]

    def _close(self, response) -> None:
        with self.sender_lock:
            if self.closed:
                return
            self.closed = True
            send_final(self.sender, response)

    # -- other threads ------------------------------------------------------------------------------------------

    def poll_cancelled(self) -> None:
        """Called by the watcher thread: a client that went away cancels the tensorrt_llm request."""
        with self.sender_lock:
            if self.closed or self.cancelled:
                return
            gone = self.sender.is_cancelled()
        if gone:
            log.info("client cancelled request %s: cancelling its tensorrt_llm request", self.request_id)
            self.cancel()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            call = self.call
        if call is not None:
            call.cancel()


def _row_keys(outputs: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    """(batch row, sequence index) of each row of a tensorrt_llm response. A response of one batch row carries
    batch_index when the request had several rows; the rows of a merged (non-decoupled) response are in order."""
    rows = outputs["output_ids"].shape[0]
    return [
        (_row_int(outputs, "batch_index", row, default=row), _row_int(outputs, "sequence_index", row, 0))
        for row in range(rows)
    ]


def _row_int(outputs, name: str, row: int, default: int) -> int:
    return int(outputs[name].reshape(-1)[row]) if name in outputs else default


def _row_flag(outputs, name: str, row: int, default: bool) -> bool:
    return bool(outputs[name].reshape(-1)[row]) if name in outputs else default
