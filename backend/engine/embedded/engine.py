"""`EmbeddedEngine`: the embedded core behind TensorRT-LLM's LLM-API surface.

One background thread owns the `EngineCore` and steps it while there is work; callers talk to it through a command
queue. `generate_async` validates the request at once (so a bad request fails its caller only) and returns a
`RequestHandle` (the seam's: iterable, async-iterable over `RequestOutput`s, with `abort()`)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Callable, Optional

from ..config import EngineConfig
from ..seam import EngineError, EngineStats, RequestHandle
from ..types import LoRARequest, RequestOutput, SamplingParams
from .engine_core import EngineCore, snapshot
from .parallel.group import RankLostError, mark_broken
from .parallel.step_watch import StepWatch, step_timeout
from .request import EngineRequest

log = logging.getLogger("tritonllm.engine")


class EmbeddedEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._stopped = threading.Event()
        # Why the engine stopped by itself (a tensor-parallel rank was lost), under _submit so that a request is
        # either queued before the engine thread's last drain or refused.
        self._fatal: Optional[str] = None
        self._submit = threading.Lock()
        self._watch: Optional[StepWatch] = None  # rank 0 of a parallel engine times its steps (a rank may hang)
        self._step_timeout = step_timeout() if config.world_size > 1 else None  # a bad value fails the caller
        # The engine thread builds the core (weights, KV cache) as well as stepping it, so that all heavy tensor
        # work stays on one thread: on CPU a second thread's OpenMP pool makes every parallel region of the
        # other wait for sleeping workers (a small matmul took 3.4x as long, see docs/benchmarks.md).
        built: "queue.SimpleQueue[Optional[BaseException]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(built,), name="tritonllm-engine", daemon=True)
        self._thread.start()
        error = built.get()
        if error is not None:
            raise error

    def _run(self, built: queue.SimpleQueue) -> None:
        try:
            self.core = EngineCore(self.config)
            self._stats = self.core.stats()
        except BaseException as exc:  # handed to the constructor, which raises it on the caller's thread
            built.put(exc)
            return
        built.put(None)
        if self._step_timeout is not None and self.core.parallel is not None and self.core.parallel.is_leader:
            self._watch = StepWatch(self._step_timeout, self._stuck)
        try:
            self._loop()
        finally:
            if self._watch is not None:
                self._watch.stop()

    # -- public API -------------------------------------------------------------------------------------------

    def generate_async(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        streaming: bool = False,
        request_id: Optional[int] = None,
        on_output: Optional[Callable[[RequestHandle, object], None]] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> RequestHandle:
        """`lora_request`: the adapter to run with (by id, name, folder or in-memory tensors); None: base model."""
        self._refuse_if_stopped()
        self.core.validate(prompt_token_ids, sampling_params)
        lora = self.core.prepare_lora(lora_request)  # parsed and checked here, off the engine thread
        if request_id is None:
            with self._ids_lock:
                request_id = next(self._ids)
        handle = RequestHandle(self, request_id, streaming, on_output)
        with self._submit:
            self._refuse_if_stopped()
            self._commands.put(("add", handle, list(prompt_token_ids), sampling_params, lora))
        return handle

    def _refuse_if_stopped(self) -> None:
        if self._fatal is not None:
            raise EngineError(f"the engine has stopped: {self._fatal}")
        if self._stopped.is_set():
            raise EngineError("the engine has been shut down")

    @property
    def failed(self) -> Optional[str]:
        """Why the engine stopped by itself (it then refuses every request), or None while it runs."""
        return self._fatal

    def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, lora_request: Optional[LoRARequest] = None
    ) -> RequestOutput:
        return self.generate_async(prompt_token_ids, sampling_params, lora_request=lora_request).result()

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """Counters as of the last finished step (or idle moment)."""
        return self._stats

    def wait_idle(self, timeout: float = 10.0) -> EngineStats:
        """Wait until the engine has no request left; returns fresh stats."""
        if not self._thread.is_alive():  # stopped (shut down, or by itself): nothing left to wait for
            return self._stats
        done = threading.Event()
        self._commands.put(("idle", done))
        if not done.wait(timeout):
            raise TimeoutError(f"engine still busy after {timeout}s")
        return self._stats

    def shutdown(self) -> None:
        if self._stopped.is_set() or not self._thread.is_alive():
            self._stopped.set()
            return
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=5)  # a step in flight finishes first; Triton's exit timeout is 10 s
        if self._thread.is_alive():
            log.warning("the engine thread is still busy after 5 s; leaving it (daemon thread)")

    # -- engine thread ----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        idle_waiters: list[threading.Event] = []
        while True:
            block = not self.core.has_work
            if not self._drain_commands(block, idle_waiters):
                break
            if self.core.has_work:
                self._step()
            if self._fatal is not None:
                break
            self._stats = self.core.stats()
            if not self.core.has_work:
                for waiter in idle_waiters:
                    waiter.set()
                idle_waiters.clear()
        for request in self.core.fail_all():
            self._deliver(request)
        if self._fatal is not None:
            self._refuse_queued(idle_waiters)
        self.core.shutdown()

    def _drain_commands(self, block: bool, idle_waiters: list) -> bool:
        while True:
            try:
                command = self._commands.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "idle":
                idle_waiters.append(command[1])

    def _abort(self, request_id: int) -> None:
        try:
            request = self.core.abort_request(request_id)
        except Exception:  # never let one abort stop the engine thread: every other request would hang
            log.exception("aborting request %s failed; failing it", request_id)
            handle = self._handles.pop(request_id, None)
            if handle is not None:
                handle._put(EngineError(f"request {request_id} could not be aborted cleanly"))
            return
        if request is not None:
            self._deliver(request)

    def _add(self, handle: RequestHandle, prompt: list[int], params: SamplingParams, lora=None) -> None:
        try:
            self.core.add_request(handle.request_id, prompt, params, lora)
        except Exception as exc:  # a request that became invalid (e.g. duplicate id) fails alone
            handle._put(exc)
            return
        self._handles[handle.request_id] = handle

    def _step(self) -> None:
        try:
            if self._watch is not None:
                self._watch.begin()
            updated = self.core.step()
            if self._watch is not None:
                self._watch.end()
            if self._fatal is not None:  # the step watch gave up on this step and answered its requests
                return
        except RankLostError as exc:  # the group is gone: no step can run again
            with self._submit:
                self._fatal = str(exc)
            self._fail_handles(EngineError(f"the engine has stopped: {exc}"))
            return
        except Exception as exc:
            log.exception("engine step failed; failing the %d active request(s)", len(self._handles))
            self._fail_handles(EngineError(f"engine step failed: {exc}"))
            return
        for request in updated:
            self._deliver(request)

    def _stuck(self, reason: str) -> None:
        """On the step watch's thread, while the engine thread waits on a rank that hangs: stop the engine and
        answer its requests now (the engine thread cannot: it may never come back; their blocks stay taken)."""
        mark_broken(reason)
        with self._submit:
            self._fatal = reason
        error = EngineError(f"the engine has stopped: {reason}")
        for handle in list(self._handles.values()):  # the engine thread is inside its step: it does not touch them
            handle._put(error)
        self._commands.put(("stop",))  # ends the loop should the step ever come back

    def _fail_handles(self, error: EngineError) -> None:
        """Fail every active request with `error` (their blocks freed) and forget their handles."""
        self.core.fail_all()
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle._put(error)

    def _refuse_queued(self, idle_waiters: list) -> None:
        """After the engine stopped by itself: fail requests still queued (none can arrive later), wake waiters."""
        error = EngineError(f"the engine has stopped: {self._fatal}")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                command[1]._put(error)
            elif command[0] == "idle":
                idle_waiters.append(command[1])
        for waiter in idle_waiters:
            waiter.set()

    def _deliver(self, request: EngineRequest) -> None:
        handle = self._handles.get(request.request_id)
        if handle is None:
            return
        if handle.streaming or request.finished:
            handle._put(snapshot(request, mark_delivered=handle.streaming))
        if request.finished:
            del self._handles[request.request_id]
