"""Stub processes end with their tritonserver.

Each Triton model runs in a stub process that tritonserver starts. When tritonserver dies (killed, crashed, or
past its exit timeout) a stub left running keeps its memory and its engine thread forever, re-parented to init.
`exit_with_parent` starts one watcher thread a process that ends it once its parent is gone."""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("tritonllm.triton")
CHECK_PERIOD_S = 1.0
_started = threading.Event()


def exit_with_parent(check_period_s: float = CHECK_PERIOD_S) -> None:
    """End this process (exit code 1) within `check_period_s` of its parent process going away. Idempotent: the
    models of one stub process share one watcher."""
    if _started.is_set():
        return
    _started.set()
    parent = os.getppid()
    threading.Thread(target=_watch, args=(parent, check_period_s), name="tritonllm-parent-watch", daemon=True).start()


def _watch(parent: int, check_period_s: float) -> None:
    while os.getppid() == parent:  # a dead parent's children are re-parented (to init or a subreaper)
        time.sleep(check_period_s)
    log.error("tritonserver (pid %d) is gone: this model process exits", parent)
    os._exit(1)
