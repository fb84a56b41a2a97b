"""The engine's start-up progress lines: a few INFO lines through logging (what Triton's log and `tritonllm
serve` show), not one per tensor; a tqdm bar only on a terminal."""

from __future__ import annotations

import logging

import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.embedded.load_progress import StepProgress, timed_step
from tritonllm.engine.embedded.loader import load_model


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_line_every_period_and_one_when_done(caplog):
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger="tritonllm.engine"):
        with StepProgress("loading weights", 100, "tensor", period_s=5.0, clock=clock, bar=False) as progress:
            for _ in range(100):
                clock.now += 0.25  # 25 s in all: a line at 5, 10, 15, 20 s, then the last one
                progress.update()
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "loading weights: 20% (20/100 tensors, 5 s)",
        "loading weights: 40% (40/100 tensors, 10 s)",
        "loading weights: 60% (60/100 tensors, 15 s)",
        "loading weights: 80% (80/100 tensors, 20 s)",
        "loading weights: done, 100 tensors in 25.0 s",
    ]


def test_a_failed_step_says_nothing_done(caplog):
    with caplog.at_level(logging.INFO, logger="tritonllm.engine"):
        try:
            with StepProgress("loading weights", 3, "tensor", bar=False) as progress:
                progress.update()
                raise ValueError("bad tensor")
        except ValueError:
            pass
        with timed_step("packed", clock=FakeClock()):
            pass
    assert [record.getMessage() for record in caplog.records] == ["packed in 0.0 s"]


def test_loading_a_model_tells_its_steps_in_a_few_lines(tmp_path, caplog):
    model_dir = build_tiny_model(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="tritonllm.engine"):
        load_model(model_dir, torch.float32, "cpu")
    messages = [record.getMessage() for record in caplog.records if record.name == "tritonllm.engine"]
    assert messages[0].startswith("loading weights: ") and " tensors from 1 file(s), " in messages[0]
    assert any(m.startswith("loading weights: done, ") for m in messages)
    assert len(messages) <= 5, messages  # a few lines, never one per tensor
