"""A step whose every row samples (plain decode) hands its hidden rows to the LM head as they are, without the
logits gather; other steps (a prompt, a draft with context logits) still gather. The same greedy tokens
either way, with and without CUDA graphs (their decode rows are the graph's first rows, no placement)."""

import pytest

from tritonllm.engine.embedded import engine_core, step_inputs
from tritonllm.engine.types import SamplingParams

from ..spec_decode.test_engine_spec import make_engine, model_dir  # noqa: F401 (fixture)

PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 120, 64], [300, 2, 11]]


def gathered_every_time(monkeypatch):
    """Makes each step gather its logits rows (as before the shortcut); returns the steps' every_row_samples."""
    seen = []

    def gathering(self, rows):
        seen.append(self.every_row_samples)
        return rows[self.logits_indices]

    monkeypatch.setattr(step_inputs.StepInputs, "logits_rows", gathering)
    return seen


def answers(engine):
    handles = [engine.generate_async(p, SamplingParams(max_tokens=6, end_id=2)) for p in PROMPTS]
    return [h.result().outputs[0].token_ids for h in handles]


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_steps_skip_the_gather_and_keep_their_tokens(model_dir, monkeypatch, request, graphs):  # noqa: F811
    if graphs:
        request.getfixturevalue("graphs_on_this_device")
    settings = {} if graphs else {"cuda_graph_config": None}
    engine = make_engine(model_dir, **settings)
    try:
        shortcut = answers(engine)
    finally:
        engine.shutdown()
    with monkeypatch.context() as patch:
        seen = gathered_every_time(patch)
        engine = make_engine(model_dir, **settings)
        try:
            assert answers(engine) == shortcut
        finally:
            engine.shutdown()
    assert True in seen and False in seen  # decode steps took the shortcut, the prompts did not


def test_overlapped_decode_reads_its_tokens_where_the_last_step_left_them(model_dir, monkeypatch):  # noqa: F811
    """Under the overlap scheduler a steady decode batch's input tokens are the last step's, row for row: the step
    reads that tensor as it is (no index copy), with the same tokens as a step that does not overlap."""
    engine = make_engine(model_dir, cuda_graph_config=None, disable_overlap_scheduler=True)
    try:
        plain = answers(engine)
    finally:
        engine.shutdown()
    monkeypatch.setattr(engine_core, "overlap_wanted", lambda config, device: not config.disable_overlap_scheduler)
    in_order, upload = [], step_inputs.HostStep.upload

    def watched(self, *args):
        in_order.append(self.has_pending and self.pending_in_order)
        return upload(self, *args)

    monkeypatch.setattr(step_inputs.HostStep, "upload", watched)
    engine = make_engine(model_dir, cuda_graph_config=None)
    try:
        assert answers(engine) == plain
        assert engine.core.num_overlapped_steps > 0
    finally:
        engine.shutdown()
    assert True in in_order
