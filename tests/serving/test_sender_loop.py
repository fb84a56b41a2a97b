"""The sender thread shared by both `tensorrt_llm` flavours: an event that fails is answered with an error and
the loop goes on for the others; a client that went away is reported once; stopping waits for what is active."""

import threading
import time
from types import SimpleNamespace

from tritonllm.triton.sender_loop import SenderLoop


class Recorder(SenderLoop):
    def __init__(self):
        super().__init__(cancellation_check_ms=5, thread_name="test-sender")
        self.answered, self.failed, self.gone = [], [], []
        self.done = threading.Event()
        self.start_sending()

    def _on_output(self, state, value):
        if value == "boom":
            raise RuntimeError("cannot answer")
        self.answered.append(value)
        if value == "last":
            with self.lock:
                self.active.pop(state.id, None)
            self.done.set()

    def _fail(self, event):
        self.failed.append(event[1])

    def _on_client_gone(self, state):
        state.cancelled = True
        self.gone.append(state.id)


def _state(number, cancelled_by_client=False):
    return SimpleNamespace(id=number, cancelled=False, sender=SimpleNamespace(is_cancelled=lambda: cancelled_by_client))


def test_a_failing_event_is_answered_with_an_error_and_later_events_still_go_out():
    loop, state = Recorder(), _state(1)
    loop.active[1] = state
    for value in ("first", "boom", "last"):
        loop.events.put((state, value))
    assert loop.done.wait(5)
    assert loop.answered == ["first", "last"] and loop.failed == ["boom"]
    loop.stop_sending(5)
    assert not loop.thread.is_alive()


def test_a_client_that_went_away_is_reported_once_while_its_request_stays_active():
    loop = Recorder()
    loop.active.update({1: _state(1, cancelled_by_client=True), 2: _state(2)})
    deadline = time.monotonic() + 5
    while not loop.gone and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # several more polls
    assert loop.gone == [1] and loop.num_active == 2
    loop.active.clear()
    loop.stop_sending(5)
    assert not loop.thread.is_alive()


def test_a_state_with_several_engine_requests_is_polled_once():
    loop, state = Recorder(), _state(7, cancelled_by_client=True)
    loop.active.update({10: state, 11: state})
    assert loop.live_states() == [state]
    loop.active.clear()
    loop.stop_sending(5)


def test_stopping_waits_until_nothing_is_active():
    loop, state = Recorder(), _state(3)
    loop.active[3] = state
    loop.stopping.set()
    time.sleep(0.05)
    assert loop.thread.is_alive()  # still one request to answer
    loop.events.put((state, "last"))
    loop.stop_sending(5)
    assert not loop.thread.is_alive() and loop.answered == ["last"]
