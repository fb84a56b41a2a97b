"""What the Medusa and EAGLE trainers share: the optimizer-step loop with its progress bar, and keeping the
weights that score best on validation data."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from tqdm import tqdm

log = logging.getLogger("tritonllm.spec_decode")


def chain_score(accuracy: Sequence[float]) -> float:
    """The expected run of accepted guesses along a chain, a1 + a1*a2 + ... (a path stops at its first miss)."""
    score, run = 0.0, 1.0
    for value in accuracy:
        run *= value
        score += run
    return score


class BestCheckpoint:
    """Keeps `module`'s state at the check that scores best; `score` is None without validation data."""

    def __init__(self, module: nn.Module, score: Optional[Callable[[], float]]):
        self.module, self.score_now = module, score
        self.score = -1.0
        self.step: Optional[int] = None
        self.state: Optional[dict[str, torch.Tensor]] = None

    def check(self, step: int) -> None:
        if self.score_now is None:
            return
        score = self.score_now()
        if score > self.score:
            self.score, self.step = score, step
            self.state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        log.info("step %d: validation score %.4f (best %.4f at step %d)", step, score, self.score, self.step)

    def restore(self) -> Optional[int]:
        """Puts the best state back; returns its step (None: nothing was validated)."""
        if self.state is not None:
            self.module.load_state_dict(self.state)
        return self.step


def deadline(started: float, time_limit: float) -> Optional[float]:
    """The `time.monotonic()` value at which training stops, `time_limit` seconds after `started`; None: no limit."""
    return started + time_limit if time_limit > 0 else None


def run_steps(
    batch_loss: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    schedule,
    steps: int,
    eval_every: int,
    best: BestCheckpoint,
    desc: str,
    progress: bool,
    clip: Optional[tuple[list[nn.Parameter], float]] = None,
    stop_at: Optional[float] = None,
) -> tuple[list[float], Optional[int]]:
    """`steps` optimizer steps on `batch_loss()` (a fresh batch each call), checking `best` every `eval_every`
    steps and at the end; returns the losses and the step whose weights were kept. Past `stop_at` (a
    `time.monotonic()` value, see `deadline`) the steps stop early, after a last check."""
    losses = []
    bar = tqdm(range(1, steps + 1), desc=desc, unit="step", disable=not progress)
    for step in bar:
        if stop_at is not None and time.monotonic() >= stop_at:
            log.warning("time limit reached after %d of %d steps; keeping the best weights so far", step - 1, steps)
            if step > 1 and (step - 1) % eval_every:
                best.check(step - 1)
            break
        loss = batch_loss()
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(*clip)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % eval_every == 0 or step == steps:
            best.check(step)
    return losses or [float("nan")], best.restore()
