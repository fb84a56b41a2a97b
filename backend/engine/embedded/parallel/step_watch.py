"""Rank 0's guard against a rank that hangs without dying (stopped, deadlocked, its GPU wedged).

A rank that dies closes its connections and the next collective raises (group.py); one that hangs keeps them
open, and the collectives' own timeout is the idle one, days. So rank 0 times each step: a step still running after
TRITONLLM_STEP_TIMEOUT_S seconds (default 300: far above any step's normal cost) means another rank is not
answering, and `on_stuck` runs on this watch's thread (the engine thread is the one waiting)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Mapping, Optional

from ...config import ConfigError

log = logging.getLogger("tritonllm.engine")
TIMEOUT_VARIABLE = "TRITONLLM_STEP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def step_timeout(environ: Mapping[str, str] = os.environ) -> float:
    raw = environ.get(TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{TIMEOUT_VARIABLE} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_VARIABLE} must be > 0, got {raw!r}")
    return value


class StepWatch:
    def __init__(self, timeout_s: float, on_stuck: Callable[[str], None]):
        self.timeout_s = timeout_s
        self.on_stuck = on_stuck
        self._started: Optional[float] = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tritonllm-step-watch", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while not self._stopped.wait(period):
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                reason = (
                    f"a step waited more than {self.timeout_s:g} s for the other ranks ({TIMEOUT_VARIABLE}): "
                    "another rank is hung"
                )
                log.error("%s", reason)
                self.on_stuck(reason)
                return
