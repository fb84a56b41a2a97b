"""The trainers' step loop: a time limit stops the steps early, keeps the best weights checked so far (a last check
included) and says so; without one every step runs. Both trainers refuse a negative `--time-limit` (test_medusa:
train-medusa stops at it)."""

import logging

import pytest
import torch
from torch import nn

from tritonllm.spec_decode.training import training_loop
from tritonllm.spec_decode.training.training_loop import BestCheckpoint, deadline, run_steps


class Clock:
    """time.monotonic for the loop: one second per call."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def _setup():
    weight = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        weight.weight.fill_(0.0)
    optimizer = torch.optim.SGD(weight.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checked = []

    def score():  # the weight moves towards 1: later is better until it overshoots (it never does here)
        checked.append(float(weight.weight.detach()))
        return checked[-1]

    def batch_loss():
        return (weight(torch.ones(1, 1)) - 1.0).pow(2).sum()

    return weight, optimizer, schedule, BestCheckpoint(weight, score), batch_loss, checked


def test_a_deadline_stops_the_steps_and_keeps_a_last_checked_state(monkeypatch, caplog):
    monkeypatch.setattr(training_loop.time, "monotonic", Clock())
    weight, optimizer, schedule, best, batch_loss, checked = _setup()
    with caplog.at_level(logging.WARNING, logger="tritonllm.spec_decode"):
        losses, kept = run_steps(
            batch_loss, optimizer, schedule, steps=100, eval_every=4, best=best, desc="t", progress=False, stop_at=5.5
        )
    assert len(losses) == 5  # the clock reads 1..5 before steps 1..5, then 6 >= 5.5
    assert kept == 5 and len(checked) == 2  # the check at step 4 and a last one at step 5
    assert "time limit reached after 5 of 100 steps" in caplog.text


def test_without_a_deadline_every_step_runs():
    weight, optimizer, schedule, best, batch_loss, checked = _setup()
    losses, kept = run_steps(
        batch_loss, optimizer, schedule, steps=8, eval_every=4, best=best, desc="t", progress=False
    )
    assert len(losses) == 8 and kept == 8 and len(checked) == 2


def test_deadline_is_none_without_a_limit():
    assert deadline(10.0, 0) is None and deadline(10.0, 5) == 15.0


@pytest.mark.parametrize("command", ["train-medusa", "train-eagle"])
def test_a_negative_time_limit_is_refused_naming_the_flag(command, tmp_path, capsys):
    from tritonllm.commands.main import main

    assert main(["spec", command, "--model", str(tmp_path), "--out", str(tmp_path / "out"), "--time-limit", "-1"]) != 0
    assert "--time-limit must be >= 0 seconds, got -1.0" in capsys.readouterr().err
