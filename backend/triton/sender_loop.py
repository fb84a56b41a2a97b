"""The sender thread both `tensorrt_llm` flavours answer through (llm_inflight, llmapi_inflight).

Engine outputs arrive on the engine's thread and are queued as events; this one thread turns them into Triton
responses, so a request's responses go out in order and a slow client never stalls the engine. Between events,
and at least every `cancellation_check_period_ms`, it asks Triton whether a client went away. One event that fails
is answered with an error and never stops the loop for the other requests."""

from __future__ import annotations

import queue
import threading
from typing import Any


class SenderLoop:
    """Subclasses register their request states in `active` (engine request id -> state, under `lock`; each state
    has `sender` and `cancelled`) and say how to answer an event, to fail one, and what to do when a client has
    gone away. Events are tuples that start with the request's state; `_on_output(*event)` answers one."""

    def __init__(self, cancellation_check_ms: int, thread_name: str):
        self.check_period = max(cancellation_check_ms, 1) / 1000
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._send_loop, name=thread_name, daemon=True)

    def start_sending(self) -> None:
        """Called once the subclass is fully built: the thread uses its attributes."""
        self.thread.start()

    def _on_output(self, state: Any, *update: Any) -> None:
        raise NotImplementedError

    def _fail(self, event: tuple) -> None:
        """Log (`log.exception`: this runs in the except block) and answer the event's request with an error after
        `_on_output` raised."""
        raise NotImplementedError

    def _on_client_gone(self, state: Any) -> None:
        raise NotImplementedError

    def _send_loop(self) -> None:
        while not (self.stopping.is_set() and not self.active):
            try:
                event = self.events.get(timeout=self.check_period)
            except queue.Empty:
                self._poll_cancellation()
                continue
            try:
                self._on_output(*event)
            except Exception:  # never let one request's failure stop the sender for the others
                self._fail(event)
            self._poll_cancellation()

    def live_states(self) -> list:
        """Each active request state once (a state with several engine requests is in `active` several times)."""
        with self.lock:
            return list({id(state): state for state in self.active.values()}.values())

    def _poll_cancellation(self) -> None:
        for state in self.live_states():
            if not state.cancelled and state.sender.is_cancelled():
                self._on_client_gone(state)

    def stop_sending(self, timeout: float) -> None:
        """Let the sender answer what is active (the caller has aborted it), then stop the thread."""
        self.stopping.set()
        self.thread.join(timeout)

    @property
    def num_active(self) -> int:
        return len(self.active)
