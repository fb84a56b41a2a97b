"""CUDA graphs for decode-only steps: `cuda_graph_config` parsing, and engine output with graphs equal to without.

On a CPU (the default) the capture is replaced by eager runs of the very forward a graph would hold, over the same
static, padded inputs: that checks the padding rows, the scratch block and the widths; TRITONLLM_TEST_DEVICE=cuda
captures and replays real graphs."""

import os

import pytest
import torch
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded import cuda_graphs
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.graph_settings import CudaGraphSettings, default_batch_sizes, parse_cuda_graph_config
from tritonllm.engine.types import SamplingParams

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then",
    "Once upon a time, in a small village",
    "Caf\u00e9 cr\u00e8me",
    "In the beginning the engineers wrote a scheduler. It admitted requests as they",
]
MAX_TOKENS = [70, 12, 30, 5, 22]  # the batch shrinks as answers end: 5, 4, 3, 2, 1 rows


def test_the_engine_pads_unless_told_not_to_and_tensorrt_llm_keeps_its_own_default():
    from tritonllm.engine.trtllm_args import _optional_llm_kwargs

    default = EngineConfig.from_dict({"model": "m"})
    assert default.cuda_graph_settings().enable_padding
    assert "cuda_graph_config" not in _optional_llm_kwargs(default)
    for value in (None, {"batch_sizes": [1, 2]}):
        config = EngineConfig.from_dict({"model": "m", "cuda_graph_config": value})
        assert _optional_llm_kwargs(config)["cuda_graph_config"] == value


def test_the_older_use_cuda_graph_switch_still_works():
    for switch, expected in ((False, None), (True, {})):
        config = EngineConfig.from_dict({"model": "m", "pytorch_backend_config": {"use_cuda_graph": switch}})
        assert config.cuda_graph_config == expected and not config.extra
    with pytest.raises(ConfigError, match="not both"):
        EngineConfig.from_dict(
            {"model": "m", "cuda_graph_config": {}, "pytorch_backend_config": {"use_cuda_graph": True}}
        )
    with pytest.raises(ConfigError, match="use_cuda_graph must be true or false"):
        EngineConfig.from_dict({"model": "m", "pytorch_backend_config": {"use_cuda_graph": "no"}})


def test_sizes_follow_tensorrt_llm():
    assert parse_cuda_graph_config({}).batch_sizes == (1, 2, 4, *range(8, 129, 8))
    assert parse_cuda_graph_config({"enable_padding": False}).batch_sizes == (*range(1, 32), 32, 64, 128)
    assert parse_cuda_graph_config({"max_batch_size": 40, "enable_padding": False}).batch_sizes == (*range(1, 33), 40)
    assert default_batch_sizes(1000, padding=False)[-4:] == (128, 256, 512, 1000)
    assert default_batch_sizes(256, padding=True)[-4:] == (120, 128, 192, 256)


def test_graphs_cover_the_engines_own_batch_size_unless_told_otherwise():
    assert EngineConfig.from_dict({"model": "m", "max_batch_size": 256}).cuda_graph_settings().batch_sizes[-1] == 256
    assert EngineConfig.from_dict({"model": "m", "max_batch_size": 32}).cuda_graph_settings().batch_sizes[-1] == 32
    told = {"model": "m", "max_batch_size": 256, "cuda_graph_config": {"max_batch_size": 64}}
    assert EngineConfig.from_dict(told).cuda_graph_settings().batch_sizes[-1] == 64
    assert parse_cuda_graph_config({"batch_sizes": [8, 2, 2], "max_batch_size": 8}).batch_sizes == (2, 8)
    assert parse_cuda_graph_config(None) is None


def test_a_batch_runs_in_its_own_size_or_padded_to_the_next():
    exact, padded = CudaGraphSettings((2, 8)), CudaGraphSettings((2, 8), enable_padding=True)
    assert [exact.graph_batch_size(n) for n in (1, 2, 3, 8, 9)] == [None, 2, None, 8, None]
    assert [padded.graph_batch_size(n) for n in (1, 2, 3, 8, 9)] == [2, 2, 8, 8, None]


@pytest.mark.parametrize(
    "value, named",
    [
        ([1, 2], "must be a mapping or null"),
        ({"batch_size": [1]}, "unknown key(s) ['batch_size']"),
        ({"batch_sizes": []}, "batch_sizes must be a non-empty list"),
        ({"batch_sizes": [0, 2]}, "batch_sizes must be a non-empty list"),
        ({"batch_sizes": [1, 4], "max_batch_size": 8}, "max_batch_size=8 must equal the largest"),
        ({"max_batch_size": -1}, "max_batch_size must be an integer >= 0"),
        ({"enable_padding": "yes"}, "enable_padding must be true or false"),
    ],
)
def test_bad_settings_name_the_key(value, named):
    with pytest.raises(ConfigError, match="cuda_graph_config") as error:
        EngineConfig.from_dict({"model": "m", "cuda_graph_config": value})
    assert named in str(error.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("graphs"), seed=3)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model_dir, [tokenizer.encode(p) for p in PROMPTS], tokenizer.eos_token_id


def run(model_dir, prompts, eos, graphs, attn_backend="VANILLA", max_tokens=MAX_TOKENS, one_by_one=False):
    """Each prompt's tokens and the engine's graphs; `one_by_one`: each request submitted once the last ended."""
    engine = EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(model_dir),
                "dtype": "float32",
                "device": DEVICE,
                "max_batch_size": 8,
                "max_seq_len": 256,
                "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 1024},
                "cuda_graph_config": graphs,
                "attn_backend": attn_backend,
            }
        )
    )
    try:

        def submit(ids, n):
            return engine.generate_async(ids, SamplingParams(max_tokens=n, end_id=eos))

        if one_by_one:
            outputs = [submit(ids, n).result().outputs[0].token_ids for ids, n in zip(prompts, max_tokens)]
        else:
            handles = [submit(ids, n) for ids, n in zip(prompts, max_tokens)]
            outputs = [h.result().outputs[0].token_ids for h in handles]
        stats = engine.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
        return outputs, engine.core.runner.graphs
    finally:
        engine.shutdown()


@pytest.mark.parametrize("attn_backend", ["VANILLA", "TRITON"])
def test_padded_graphs_give_the_eager_tokens(tiny, graphs_on_this_device, attn_backend):
    model_dir, prompts, eos = tiny
    expected, no_graphs = run(model_dir, prompts, eos, None)
    assert no_graphs is None
    outputs, graphs = run(model_dir, prompts, eos, {"batch_sizes": [1, 2, 4, 8], "enable_padding": True}, attn_backend)
    assert outputs == expected
    sizes = {batch for batch, _, _ in graphs.graphs}
    widths = {width for _, _, width in graphs.graphs}
    assert 8 in sizes and 4 in sizes  # 5 rows padded to 8, 3 to 4
    if attn_backend == "VANILLA":  # masked attention reads the whole width: powers of two, growing
        assert len(widths) > 1 and all(width & (width - 1) == 0 for width in widths)
    else:  # the kernels read each sequence up to its length: one width, the longest a sequence can have
        assert widths == {graphs.max_width}
    assert graphs.replays > 30


@pytest.mark.parametrize("attn_backend", ["VANILLA", "TRITON"])
def test_short_prompts_run_in_graphs_and_give_the_eager_tokens(tiny, graphs_on_this_device, attn_backend):
    model_dir, _, eos = tiny
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = " ".join(PROMPTS)
    ids = tokenizer.encode(text * 4)
    # padded to 64, 128 and 256 rows; cut at different places, so that no prompt reuses another's cached prefix
    prompts = [ids[start : start + n] for start, n in ((0, 40), (7, 100), (13, 150))]
    expected, _ = run(model_dir, prompts, eos, None, max_tokens=[6, 6, 6], one_by_one=True)
    outputs, graphs = run(model_dir, prompts, eos, {}, attn_backend, max_tokens=[6, 6, 6], one_by_one=True)
    assert outputs == expected
    assert {rows for _, rows, _ in graphs.graphs} >= {64, 128, 256}


def modelless_graphs() -> cuda_graphs.DecodeGraphs:
    """Default graph settings with no model behind them: for the choice of shape, which runs nothing."""
    return cuda_graphs.DecodeGraphs(
        model=None,
        kv_caches=[],
        settings=parse_cuda_graph_config({}),
        block_size=4,
        max_blocks_per_seq=64,
        scratch_block=99,
        device=torch.device("cpu"),
    )


def test_prompts_take_graphs_of_up_to_prompt_graph_rows():
    graphs = modelless_graphs()
    assert graphs.graph_shape([128]) == (1, 128)
    assert graphs.graph_shape([200]) == (1, 256)
    assert graphs.graph_shape([100, 90]) == (2, 128)
    assert graphs.graph_shape([300]) is None  # over PROMPT_GRAPH_ROWS: eager
    assert graphs.graph_shape([200, 200]) is None
    assert graphs.graph_shape([40, 1, 1, 1]) == (4, 64)
    assert graphs.graph_shape([40] + [1] * 7) is None  # eight sequences of 64 rows
    assert graphs.graph_shape([1] * 8) == (8, 1)
    assert graphs.graph_shape([32] * 8) == (8, 32)  # draft trees: within MAX_GRAPH_ROWS, as before


def test_a_failed_capture_leaves_the_engine_running_eagerly(tiny, graphs_on_this_device, monkeypatch, caplog):
    model_dir, prompts, eos = tiny
    expected, _ = run(model_dir, prompts, eos, None)

    def failing_capture(forward, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "capture", failing_capture)
    outputs, graphs = run(model_dir, prompts, eos, {})
    assert outputs == expected and graphs.failed and not graphs.graphs and graphs.replays == 0
    assert "decode steps run without graphs from now on" in caplog.text


def test_without_padding_only_the_listed_sizes_use_graphs(tiny, graphs_on_this_device):
    model_dir, prompts, eos = tiny
    expected, _ = run(model_dir, prompts, eos, None)
    outputs, graphs = run(model_dir, prompts, eos, {"batch_sizes": [2], "enable_padding": False})
    assert outputs == expected
    assert {batch for batch, _, _ in graphs.graphs} == {2} and graphs.replays > 0


def test_padding_rows_write_only_the_scratch_block(tiny, graphs_on_this_device):
    model_dir, prompts, eos = tiny
    engine = EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(model_dir),
                "dtype": "float32",
                "device": DEVICE,
                "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 64},
                "cuda_graph_config": {},
            }
        )
    )
    try:
        core = engine.core
        assert len(core.runner.kv_caches[0][0]) == core.block_manager.num_blocks + 1
        assert core.runner.graphs.scratch_slot == core.block_manager.num_blocks * 4
    finally:
        engine.shutdown()


def decode_metadata(slots, tables, context_lens, block_size=4):
    from tritonllm.engine.embedded.attention import step_metadata

    return step_metadata(
        slots,
        tables,
        list(range(len(slots))),
        [1] * len(slots),
        context_lens,
        block_size,
        [None] * len(slots),
        "cpu",
        torch.float32,
    )


def test_loading_fewer_rows_turns_the_rest_back_into_padding_rows():
    graph = cuda_graphs._Graph(
        seqs=4, rows=1, width=4, block_size=4, scratch_slot=40, dtype=torch.float32, device="cpu"
    )

    def load(ids, positions, meta):
        where = torch.from_numpy(cuda_graphs.placement(meta, 1))
        graph.load(torch.tensor(ids), torch.tensor(positions), meta, where, cuda_graphs.visible_keys(meta, 1, 16))

    load([5, 6, 7], [13, 10, 7], decode_metadata([13, 22, 7], [[1, 2, 3, 3], [4, 5, 5, 5], [6, 1, 1, 1]], [14, 11, 8]))
    assert graph.slots.tolist() == [13, 22, 7, 40]
    load([8], [5], decode_metadata([9], [[2, 3]], [6]))  # the long ones ended: two blocks wide now
    assert graph.slots.tolist() == [9, 40, 40, 40]  # the rows of the ended ones write nowhere that matters
    assert graph.tables[0, :2].tolist() == [2, 3]
    assert (graph.mask[0, 0, 0] == 0).nonzero().flatten().tolist() == list(range(6))  # not the wider mask before


def test_a_draft_tree_is_padded_to_its_rows_with_its_own_mask():
    from tritonllm.engine.embedded.attention import step_metadata

    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root and two siblings
    meta = step_metadata(
        [9, 10, 11, 3], [[0, 2, 1, 1], [5]], [0, 3], [3, 1], [12, 4], 4, [tree, None], "cpu", torch.float32
    )
    assert cuda_graphs.placement(meta, 4).tolist() == [0, 1, 2, 4]
    visible = cuda_graphs.visible_keys(meta, 4, 16)
    assert visible[0, 0].nonzero().flatten().tolist() == list(range(10))  # the root: context and itself
    assert visible[0, 2].nonzero().flatten().tolist() == [*range(10), 11]  # a sibling: the root and itself
    assert visible[0, 3].nonzero().flatten().tolist() == [0]  # a padding row
    assert visible[1, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_a_step_that_padding_would_swell_runs_eagerly():
    from tritonllm.engine.embedded.attention import step_metadata

    graphs = modelless_graphs()
    decodes, prompt = 64, 20  # every decode would be padded to the prompt's 32 rows: 2,304 rows for 84 tokens
    lens = [1] * decodes + [prompt]
    meta = step_metadata(
        list(range(sum(lens))),
        [[0]] * (decodes + 1),
        [*range(decodes), decodes],
        lens,
        [3] * decodes + [prompt],
        4,
        [None] * (decodes + 1),
        "cpu",
        torch.float32,
    )
    tokens = torch.zeros(sum(lens), dtype=torch.long)
    assert graphs.run(tokens, tokens, meta) is None and not graphs.graphs
