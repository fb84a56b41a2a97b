"""Leader mode's end when a rank is lost: the tensorrt_llm model's engine stops by itself (a tensor-parallel rank
died: engine/embedded/parallel/group.py) and answers every request with that error; a server that kept saying it
is ready would only fail each client in turn. So once the engine says it failed, this model's process asks its
tritonserver to shut down (SIGTERM, as `kill PID` does): the server stops being ready and exits, as TensorRT-LLM's
leader mode ends when an MPI rank dies."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("tritonllm.triton")
CHECK_PERIOD_S = 0.5


def stop_server_when_engine_fails(engine, check_period_s: float = CHECK_PERIOD_S) -> threading.Thread:
    """Watch `engine.failed` (the embedded engine's reason for stopping by itself) from a daemon thread; once it is
    set, SIGTERM the parent process (tritonserver). Returns the thread."""
    server = os.getppid()
    thread = threading.Thread(
        target=_watch, args=(engine, server, check_period_s), name="tritonllm-rank-watch", daemon=True
    )
    thread.start()
    return thread


def _watch(engine, server: int, check_period_s: float) -> None:
    while getattr(engine, "failed", None) is None:
        time.sleep(check_period_s)
    log.error("the engine stopped (%s): stopping tritonserver (pid %d)", engine.failed, server)
    os.kill(server, signal.SIGTERM)
