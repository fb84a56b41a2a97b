"""Pipeline parallelism on CPU with gloo: two stages (and two stages of two tensor ranks) launched with torchrun's
environment give the single rank's greedy tokens (fp32) and close logits, free every block after aborts,
preemption and prefix reuse, and a lost stage fails rank 0's requests instead of hanging them. Plus the layer split,
the micro-batches and what a stage loads."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tritonllm.checkpoints.tiny import build_tiny_model, random_weights
from tritonllm.engine.config import ConfigError
from tritonllm.engine.embedded.parallel.layout import ParallelLayout, stage_layers
from tritonllm.engine.embedded.parallel.sharded_load import load_sharded
from tritonllm.engine.embedded.parallel.stages import micro_batches
from tritonllm.engine.embedded.scheduler import ScheduledBatch
from tritonllm.engine.embedded.sequence import Sequence
from tritonllm.engine.types import SamplingParams

from .parallel_ranks import assert_adapters_changed_their_requests, launch, peft_adapters, start_ranks
from .tp_worker import run_scenarios


def three_layer_llama(out: Path) -> Path:
    """The tiny Llama (untied head) with three layers: two stages split them 2 + 1."""
    model_dir = build_tiny_model(out, seed=7, arch="llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (model_dir / "config.json").write_text(json.dumps(config))
    save_file(random_weights(config, 7), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    return three_layer_llama(tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    """Tied embeddings (the last stage computes logits with the embedding), q/k/v biases, 2 KV heads."""
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), seed=5, arch="qwen2")


def assert_same_as_one_rank(single: list, leader: list) -> None:
    for one, two in zip(single, leader):
        assert two["tokens"] == one["tokens"] and two.get("accepted") == one.get("accepted")
        assert two.get("drafts") == one.get("drafts")
    roomy_one, roomy_two = single[0], leader[0]
    assert roomy_two["prefix_tokens"] == roomy_one["prefix_tokens"]
    for key in ("logits", "context_logits"):
        for one, two in zip(roomy_one[key], roomy_two[key]):
            torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-4)


def assert_every_block_freed(leader: list, followers: list[list]) -> None:
    roomy, preempting, _served, beams, ngram, draft, _guided, lora = leader
    assert_adapters_changed_their_requests(lora)  # LoRA ran, each stage with its layers' parts of the adapters
    assert all(len(outputs) == 3 for outputs in beams["tokens"])  # beam search ran (3 beams a request)
    assert ngram["drafted"] > 0 and draft["accepted"] == draft["drafted"] > 0  # so did speculative decoding
    assert roomy["aborted_tokens"] < 20 and roomy["reused_blocks"] >= 3  # the scenarios did abort and reuse
    assert preempting["preemptions"] > 0
    for result in leader:
        start, end = result["free_blocks"]
        assert end == start
    for follower in followers:  # they ran exactly rank 0's steps, engine by engine, and stopped cleanly
        assert [r["steps"] for r in follower] == [r["steps"] for r in leader] and all(r["steps"] for r in leader)


@pytest.fixture
def adapters_of(monkeypatch, tmp_path):
    """The LoRA scenario's adapters of a model, named to tp_worker.py (and to the single rank in this process)."""

    def make(model_dir: Path) -> None:
        adapters = peft_adapters(model_dir, tmp_path / "adapters")
        monkeypatch.setenv("TP_WORKER_LORA", os.pathsep.join(map(str, adapters)))

    return make


def test_two_stages_give_one_ranks_tokens_and_free_every_block(llama3, tmp_path, adapters_of):
    adapters_of(llama3)
    single = run_scenarios(str(llama3), 1)
    leader, follower = launch(llama3, tmp_path, world_size=2, pipeline=2)
    assert_same_as_one_rank(single, leader)
    assert_every_block_freed(leader, [follower])


def test_two_stages_of_two_tensor_ranks(qwen2, tmp_path, adapters_of):
    adapters_of(qwen2)
    single = run_scenarios(str(qwen2), 1)
    leader, *followers = launch(qwen2, tmp_path, world_size=4, pipeline=2)
    assert_same_as_one_rank(single, leader)
    assert_every_block_freed(leader, followers)


def test_a_lost_stage_fails_rank_0s_requests_instead_of_hanging_them(llama3, tmp_path):
    procs = start_ranks(llama3, tmp_path, "follower", world_size=2, pipeline=2)
    try:
        ready = tmp_path / "rank0.json.ready"
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[0][-3000:]
            time.sleep(0.05)
        procs[1].kill()
        procs[1].wait()
        (tmp_path / "rank0.json.go").touch()
        output, _ = procs[0].communicate(timeout=60)  # a hang fails here
        assert procs[0].returncode == 0, output[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert len(seen["before"]) == 4
    assert "another rank is gone" in seen["during"] and seen["after"].startswith("the engine has stopped")


# -- the layer split, micro-batches, a stage's weights ------------------------------------------------------------


def test_layers_split_evenly_the_first_stages_taking_the_rest():
    assert stage_layers(3, 2) == [range(0, 2), range(2, 3)]
    assert stage_layers(32, 3) == [range(0, 11), range(11, 22), range(22, 32)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ConfigError, match="pipeline_parallel_size=3 is more than the model's 2 layers"):
        stage_layers(2, 3)


def test_ranks_fill_a_stage_before_the_next():
    layouts = [ParallelLayout(tensor=2, pipeline=2, rank=rank) for rank in range(4)]
    assert [(lay.stage, lay.tp_rank) for lay in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layouts[1].next_rank == 3 and layouts[3].previous_rank == 1
    assert all(lay.logits_rank == 2 for lay in layouts)
    assert layouts[2].is_last_stage and not layouts[1].is_last_stage


def batch_of(token_counts: list[int]) -> ScheduledBatch:
    batch = ScheduledBatch()
    for index, count in enumerate(token_counts):
        batch.add(Sequence(index, index, 0, [1] * count, SamplingParams(max_tokens=1)), count)
    return batch


@pytest.mark.parametrize(
    "counts, parts, expected",
    [
        ([1, 1, 1, 1], 2, [[1, 1], [1, 1]]),
        ([1, 1, 1], 2, [[1, 1], [1]]),
        ([30, 1, 1, 1], 2, [[30], [1, 1, 1]]),
        ([1, 1, 1, 30], 2, [[1, 1, 1], [30]]),
        ([5], 2, [[5]]),
        ([1, 1], 4, [[1], [1]]),
        ([1, 1, 1, 1, 1, 1], 3, [[1, 1], [1, 1], [1, 1]]),
    ],
)
def test_micro_batches_are_consecutive_runs_of_about_equal_tokens(counts, parts, expected):
    batch = batch_of(counts)
    split = micro_batches(batch, parts)
    assert [part.num_new_tokens for part in split] == expected
    assert [seq for part in split for seq in part.seqs] == batch.seqs


class StageRank:
    """What load_sharded reads of a group: stage `stage` of two, one tensor rank."""

    tp_rank, tp_size, device = 0, 1, torch.device("cpu")

    def __init__(self, stage: int):
        self.layout = ParallelLayout(tensor=1, pipeline=2, rank=stage)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_holds_its_layers_and_only_the_ends_it_needs(llama3, qwen2, stage):
    from safetensors.torch import load_file

    model, full = load_sharded(llama3, torch.float32, torch.device("cpu"), StageRank(stage))  # type: ignore[arg-type]
    weights = load_file(llama3 / "model.safetensors")
    first = 0 if stage == 0 else 2
    assert len(model.layers) == (2 if stage == 0 else 1) and full.num_layers == 3
    for local, layer in enumerate(model.decoder_layers):
        expected = weights[f"model.layers.{first + local}.mlp.down_proj.weight"]
        assert torch.equal(layer.mlp.down_proj.weight, expected)
    assert model.embed_tokens.weight.shape[0] == (full.vocab_size if stage == 0 else 0)
    assert (model.lm_head is not None) == (stage == 1)
    if stage == 1:
        assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])  # type: ignore[union-attr]
        assert torch.equal(model.norm.weight, weights["model.norm.weight"])
    tied, _ = load_sharded(qwen2, torch.float32, torch.device("cpu"), StageRank(stage))  # type: ignore[arg-type]
    assert tied.embed_tokens.weight.shape[0] > 0  # the first stage looks up; the last computes tied logits


def test_a_ranks_kv_cache_is_sized_by_its_own_layers_and_heads(monkeypatch):
    """Without max_tokens a rank's token budget counts the bytes of its stage's layers and its KV heads; the ranks of
    a CPU run share the host's memory."""
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.embedded import device as device_module
    from tritonllm.engine.embedded.assembly import Placement, Target, rank_kv_blocks

    from .test_tensor_parallel import model_config

    monkeypatch.setattr(device_module, "available_memory_bytes", lambda _device: 2**30)
    full = model_config(num_hidden_layers=4)  # 2 KV heads of 8, fp32: 4 * 2 * 2 * 8 * 4 = 512 bytes a token
    settings = {"model": "m", "max_batch_size": 10**6, "kv_cache_config": {"tokens_per_block": 4}}
    placement = Placement(torch.device("cpu"), "VANILLA", torch.float32, torch.float32)

    def blocks(layers: range, kv_heads: int, **sizes) -> int:
        target = Target(None, full, 128, (None,) * 4, layers, 8, kv_heads)  # type: ignore[arg-type]
        return rank_kv_blocks(EngineConfig.from_dict({**settings, **sizes}), placement, target)

    whole = int(2**30 * 0.9) // 512 // 4  # the default fraction 0.9 of the memory, in blocks of 4 tokens
    assert blocks(range(4), 2, tensor_parallel_size=1, pipeline_parallel_size=1) == whole
    # a stage of 1 of 4 layers: 4x fewer bytes a token, the host's memory shared by 2 ranks
    assert blocks(range(3, 4), 2, pipeline_parallel_size=2) == int(2**30 * 0.9) // 128 // 2 // 4
    assert blocks(range(4), 1, tensor_parallel_size=2) == int(2**30 * 0.9) // 256 // 2 // 4


def test_a_followers_plan_is_moved_onto_its_own_device():
    """Unpickled tensors keep the sender's device (rank 0's GPU): a follower moves the whole plan onto its own. The
    micro-batches travel as host arrays (each rank uploads its own inputs); tensors left in a plan (tail masks, LoRA
    weights) are moved, however deep in its dataclasses and lists."""
    from tritonllm.engine.embedded.parallel.step_sync import MicroStep, StepPlan, on_device

    host = NestedMetadata(torch.zeros(3), [torch.ones(2), None])
    plan = StepPlan([1, 2], [MicroStep(host, [[0, 1]])], lora_slots=[0, -1])  # type: ignore[arg-type]
    moved = on_device(plan, torch.device("meta"))
    step = moved.micro[0]
    assert step.host.slot_mapping.is_meta and step.host.masks[0].is_meta and step.host.masks[1] is None
    assert moved.new_blocks == [1, 2] and step.context_indices == [[0, 1]] and moved.lora_slots == [0, -1]
    assert not plan.micro[0].host.slot_mapping.is_meta


@dataclass
class NestedMetadata:
    """A dataclass with tensors in it and in a list, as AttentionMetadata."""

    slot_mapping: torch.Tensor
    masks: list


def test_dummy_weights_need_only_the_config(llama3, tmp_path):
    """load_format dummy under parallelism (benchmarks): a stage's parameters filled, no weight file read."""
    import shutil

    shutil.copy(llama3 / "config.json", tmp_path / "config.json")
    model, full = load_sharded(tmp_path, torch.float32, torch.device("cpu"), StageRank(1), "dummy")  # type: ignore[arg-type]
    assert len(model.layers) == 1 and model.lm_head is not None and full.num_layers == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.lm_head.weight.std() > 0 and torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
