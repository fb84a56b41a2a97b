"""The overlap scheduler (TensorRT-LLM's `disable_overlap_scheduler: false`): each step is scheduled and launched
before the last step's tokens reach the host; decoding sequences read their input token on the device, and a
sequence that ended in the last step computes one token too many, which is dropped. On CPU the engine does not
overlap (nothing to gain); these tests switch it on there, so the pipelining logic runs in CI. Random traffic
(arrivals mid-flight, streaming, aborts, refused requests, stop words, sampled requests, beams, which make steps
wait for their tokens) keeps every greedy answer and frees every block, eagerly and in CUDA graphs."""

import pytest

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded import engine_core

from ..spec_decode.test_engine_spec import (
    SETTINGS,
    assert_all_blocks_free,
    make_engine,
    model_dir,  # noqa: F401 (fixture)
)
from ..traffic import close_together, mismatches, preemptions, random_traffic, send

VOCAB = 400


@pytest.fixture
def overlap_on_cpu(monkeypatch):
    monkeypatch.setattr(engine_core, "overlap_wanted", lambda config, device: not config.disable_overlap_scheduler)


@pytest.fixture(scope="module")
def solo(model_dir):  # noqa: F811
    engine = make_engine(model_dir, max_beam_width=2, cuda_graph_config=None, disable_overlap_scheduler=True)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "setting, seed, graphs",
    [("preempting", 31, False), ("chunked_reuse", 32, False), ("plain", 33, True), ("preempting", 34, True)],
)
def test_overlapped_traffic_keeps_every_greedy_answer(
    model_dir,
    solo,
    overlap_on_cpu,
    request,  # noqa: F811
    setting,
    seed,
    graphs,
):
    if graphs:
        request.getfixturevalue("graphs_on_this_device")
    traffic = random_traffic(seed, count=40, vocab=VOCAB, beams=True)
    if setting == "preempting":
        traffic = close_together(traffic)
    engine = make_engine(
        model_dir, max_beam_width=2, **SETTINGS[setting], **({} if graphs else {"cuda_graph_config": None})
    )
    try:
        results = send(engine, traffic)
        assert_all_blocks_free(engine)
        assert engine.core.num_overlapped_steps > 0
        assert engine.core.num_overlapped_steps < engine.core.num_steps  # beams made some steps wait
    finally:
        engine.shutdown()
    assert len(results) > 30 and any(aborted for aborted, _ in results.values())
    if setting == "preempting":
        assert preemptions(results) > 0
    assert mismatches(solo, traffic, results) == []


def test_overlap_is_on_for_cuda_only_and_the_switch_turns_it_off():
    on, off = (
        EngineConfig.from_dict({"model": "m"}),
        EngineConfig.from_dict({"model": "m", "disable_overlap_scheduler": True}),
    )
    import torch

    assert engine_core.overlap_wanted(on, torch.device("cuda"))
    assert not engine_core.overlap_wanted(off, torch.device("cuda"))
    assert not engine_core.overlap_wanted(on, torch.device("cpu"))


def test_no_step_runs_past_a_known_end(model_dir, overlap_on_cpu):  # noqa: F811
    from tritonllm.engine.types import SamplingParams

    engine = make_engine(model_dir, cuda_graph_config=None)
    try:
        output = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(output.outputs[0].token_ids) == 6
        assert engine.core.num_steps == 6 and engine.core.num_overlapped_steps == 6
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
