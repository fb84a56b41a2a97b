"""Progress of the engine's start-up steps (weights read, weights packed, KV cache sized), told as a few log lines.

On a terminal a step over many items also gets a tqdm bar. Inside Triton the engine's stderr is a pipe, where a
bar would come out as one long line of carriage returns, so there the step is a line at most every PERIOD_S
(logging goes to Triton's log, and `tritonllm serve` shows it) and a last line with its duration."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Callable, Iterator, Optional

from tqdm import tqdm

log = logging.getLogger("tritonllm.engine")
PERIOD_S = 5.0


class StepProgress:
    """One step over `total` items: `update()` per item, `done()` at the end (or use it as a context manager)."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        period_s: float = PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        bar: Optional[bool] = None,
    ):
        self.what, self.total, self.unit, self.period_s, self.clock = what, total, unit, period_s, clock
        self.count = 0
        self.started = self.last_line = clock()
        use_bar = sys.stderr.isatty() if bar is None else bar
        self.bar = tqdm(total=total, desc=what.capitalize(), unit=unit) if use_bar else None

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if now - self.last_line >= self.period_s and self.count < self.total:
            self.last_line = now
            log.info(
                "%s: %d%% (%d/%d %ss, %.0f s)",
                self.what,
                100 * self.count // max(self.total, 1),
                self.count,
                self.total,
                self.unit,
                now - self.started,
            )

    def done(self, detail: str = "") -> None:
        if self.bar is not None:
            self.bar.close()
        log.info("%s: done, %d %ss%s in %.1f s", self.what, self.count, self.unit, detail, self.clock() - self.started)

    def __enter__(self) -> "StepProgress":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is None:
            self.done()
        elif self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def timed_step(what: str, clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """One line once a step without items is done: `<what> in <seconds> s`."""
    started = clock()
    yield
    log.info("%s in %.1f s", what, clock() - started)
