"""Random traffic (tests/traffic.py: requests joining mid-flight, streaming, client aborts, refused requests, stop
words, sampled and opted-out requests) through engines that speculate with each method, under chunked prefill with
prefix reuse or a KV cache small enough to preempt: every greedy answer equals the request's plain answer alone,
and every KV block (the draft model's and the Eagle layer's too) is free afterwards. Also with decode and
verification steps in CUDA graphs (on CPU, eager runs of the padded forward a graph would hold)."""

import pytest

from tritonllm.engine.embedded.speculation.eagle import random_eagle
from tritonllm.engine.embedded.speculation.eagle3 import random_eagle3

from ..traffic import close_together, mismatches, preemptions, random_traffic, send
from .test_engine_spec import (  # noqa: F401 (fixtures)
    SETTINGS,
    assert_all_blocks_free,
    make_engine,
    medusa_dir,
    methods,
    model_dir,
    other_draft_dir,
)

VOCAB = 400  # prompts draw their tokens below this


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, model_dir):  # noqa: F811
    return random_eagle(model_dir, tmp_path_factory.mktemp("eagle"), seed=1)


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory, model_dir):  # noqa: F811
    return random_eagle3(
        model_dir, tmp_path_factory.mktemp("eagle3"), seed=1, draft_vocab_size=300, capture_layers=[0, 1]
    )


@pytest.fixture(scope="module")
def solo(model_dir):  # noqa: F811
    engine = make_engine(model_dir, max_beam_width=2, cuda_graph_config=None)  # eager: the plain reference
    yield engine
    engine.shutdown()


def speculative_config(method, model_dir, other_draft_dir, medusa_dir, eagle_dir, eagle3_dir):  # noqa: F811
    eagle = {"decoding_type": "Eagle", "speculative_model_dir": str(eagle_dir), "max_draft_len": 3}
    return {
        **methods(model_dir, other_draft_dir, medusa_dir),
        "eagle3_tree": {
            **eagle,
            "decoding_type": "Eagle3",
            "speculative_model_dir": str(eagle3_dir),
            "eagle_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]],
        },
        "eagle_tree": {**eagle, "eagle_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]},
        "eagle_dynamic": {**eagle, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "max_total_draft_tokens": 5},
    }.get(method)


CASES = [
    ("none", "preempting", 1),
    ("none", "chunked_reuse", 2),
    ("ngram", "chunked_reuse", 3),
    ("draft_other", "preempting", 4),
    ("medusa", "preempting", 5),
    ("lookahead", "chunked_reuse", 6),
    ("eagle_tree", "preempting", 7),
    ("eagle_dynamic", "chunked_reuse", 8),
    ("eagle3_tree", "preempting", 9),
]
GRAPH_CASES = [
    ("none", "chunked_reuse", 21),
    ("medusa", "preempting", 22),
    ("lookahead", "chunked_reuse", 23),
    ("eagle_tree", "preempting", 24),
    ("eagle3_tree", "chunked_reuse", 25),
]


@pytest.mark.parametrize(
    "method, setting, seed, graphs", [(*case, False) for case in CASES] + [(*case, True) for case in GRAPH_CASES]
)
def test_random_traffic_keeps_every_greedy_answer(
    model_dir,
    other_draft_dir,
    medusa_dir,
    eagle_dir,  # noqa: F811
    eagle3_dir,
    solo,
    request,
    method,
    setting,
    seed,
    graphs,
):
    if graphs:
        request.getfixturevalue("graphs_on_this_device")
    spec = speculative_config(method, model_dir, other_draft_dir, medusa_dir, eagle_dir, eagle3_dir)
    traffic = random_traffic(seed, count=40, vocab=VOCAB, beams=spec is None)
    if setting == "preempting":
        traffic = close_together(traffic)
    engine = make_engine(
        model_dir,
        spec,
        max_beam_width=1 if spec else 2,
        **SETTINGS[setting],
        **({} if graphs else {"cuda_graph_config": None}),
    )
    try:
        results = send(engine, traffic)
        assert_all_blocks_free(engine)
        runner = engine.core.runner
        assert runner.graphs.replays > 0 if graphs else runner.graphs is None
    finally:
        engine.shutdown()
    assert len(results) > 30 and any(aborted for aborted, _ in results.values())
    if setting == "preempting" and spec is not None:
        assert preemptions(results) > 0
    assert mismatches(solo, traffic, results) == []
