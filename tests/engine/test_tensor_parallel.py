"""Tensor parallelism on CPU with gloo: two ranks launched with torchrun's environment give the single rank's
greedy tokens (fp32) and close logits, and free every block after aborts, preemption and prefix reuse. Plus the
rank environment's parsing and the sharding rules."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded.network.model_config import ModelConfig
from tritonllm.engine.embedded.parallel.environment import read_rank_environment
from tritonllm.engine.embedded.parallel.layout import ParallelLayout
from tritonllm.engine.embedded.parallel.sharding import ShardPlan, TensorSlice
from tritonllm.engine.embedded.speculation.eagle import random_eagle
from tritonllm.engine.embedded.speculation.eagle3 import random_eagle3

from .parallel_ranks import (
    assert_adapters_changed_their_requests,
    launch,
    one_kv_head_llama,
    peft_adapters,
    start_ranks,
)
from .tp_worker import run_scenarios


@pytest.fixture(scope="module", params=["qwen2", "llama-1kv"])
def tiny(request, tmp_path_factory) -> Path:
    """qwen2: q/k/v biases, tied embeddings, 2 KV heads (one per rank); llama-1kv: untied head, one replicated KV
    head, biases everywhere."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "llama-1kv":
        return one_kv_head_llama(out)
    return build_tiny_model(out, seed=5, arch="qwen2")


@pytest.mark.parametrize("lost", ["follower", "leader", "hung"])
def test_a_rank_that_dies_fails_the_others_instead_of_hanging_them(tiny, tmp_path, lost, monkeypatch):
    """ "hung": the follower is stopped (SIGSTOP), alive but silent; rank 0's step watch gives up after 3 s."""
    monkeypatch.setenv("TRITONLLM_STEP_TIMEOUT_S", "3")
    procs = start_ranks(tiny, tmp_path, lost)
    try:
        ready = tmp_path / "rank0.json.ready"
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[0][-3000:]
            time.sleep(0.05)
        victim, survivor = (procs[0], 1) if lost == "leader" else (procs[1], 0)
        if lost == "hung":
            victim.send_signal(signal.SIGSTOP)
        else:
            victim.kill()
            victim.wait()
        (tmp_path / "rank0.json.go").touch()
        output, _ = procs[survivor].communicate(timeout=60)  # a hang fails here
        assert procs[survivor].returncode == 0, output[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seen = json.loads((tmp_path / f"rank{survivor}.json").read_text())
    if lost in ("follower", "hung"):  # rank 0: the request in flight fails, later ones are refused, it says why
        why = "another rank is gone" if lost == "follower" else "waited more than 3 s for the other ranks"
        assert len(seen["before"]) == 4
        assert why in seen["during"] and why in seen["after"]
        assert seen["after"].startswith("the engine has stopped") and why in seen["failed"]
    else:  # the follower's loop ends with the error instead of waiting for rank 0's next step
        assert "rank 1 of 2: broadcast failed, another rank is gone" in seen["follower"]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """The single rank's and the two ranks' scenarios (the LoRA one with three PEFT adapters of the tiny model,
    Medusa's with two heads)."""
    adapters = peft_adapters(tiny, tmp_path_factory.mktemp("adapters"))
    os.environ["TP_WORKER_LORA"] = os.pathsep.join(map(str, adapters))
    os.environ["TP_WORKER_MEDUSA"] = str(medusa_heads(tiny, tmp_path_factory.mktemp("medusa")))
    drafts = tmp_path_factory.mktemp("eagle")
    eagle = random_eagle(tiny, drafts / "eagle", seed=1, scale=3.0)
    eagle3 = random_eagle3(tiny, drafts / "eagle3", seed=2, capture_layers=[0, 1])
    os.environ["TP_WORKER_EAGLE"] = os.pathsep.join([str(eagle), str(eagle3)])
    try:
        yield run_scenarios(str(tiny), 1), launch(tiny, tmp_path_factory.mktemp("ranks"))
    finally:
        for name in ("TP_WORKER_LORA", "TP_WORKER_MEDUSA", "TP_WORKER_EAGLE"):
            del os.environ[name]


def medusa_heads(model_dir: Path, out: Path) -> Path:
    """Two random Medusa heads with their own vocabulary projections, started from the model's output head."""
    from safetensors.torch import load_file

    from tritonllm.spec_decode.medusa import MedusaHeads, save_medusa

    weights = load_file(str(model_dir / "model.safetensors"))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    torch.manual_seed(0)
    heads = MedusaHeads(head.shape[1], head.shape[0], num_heads=2)
    heads.copy_lm_head(head)
    with torch.no_grad():
        for block in heads.heads:
            block[0].linear.weight.normal_(std=0.05)
    return save_medusa(heads, out)


def test_two_ranks_give_one_ranks_greedy_tokens_and_logits(runs):
    single, (leader, follower) = runs
    for one, two in zip(single, leader, strict=True):
        assert two["tokens"] == one["tokens"] and two.get("accepted") == one.get("accepted")
        assert two.get("drafts") == one.get("drafts")  # drafters on rank 0 read what one rank's read
    roomy_one, roomy_two = single[0], leader[0]
    assert roomy_two["prefix_tokens"] == roomy_one["prefix_tokens"]
    for key in ("logits", "context_logits"):
        for one, two in zip(roomy_one[key], roomy_two[key]):
            torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-4)


def test_abort_preemption_and_prefix_reuse_free_every_block(runs):
    single, (leader, follower) = runs
    roomy, preempting, _served, beams, ngram, draft, _guided, lora, medusa, eagle, eagle3 = leader
    for drafter in (medusa, eagle, eagle3):  # drafts ran on rank 0 (and were accepted as on one rank)
        assert drafter["drafted"] > 0
    assert_adapters_changed_their_requests(lora)
    assert all(len(outputs) == 3 for outputs in beams["tokens"])  # beam search ran (3 beams a request)
    assert ngram["drafted"] > 0 and draft["accepted"] == draft["drafted"] > 0  # so did speculative decoding
    assert roomy["aborted_tokens"] < 20 and roomy["reused_blocks"] >= 3  # the scenarios did abort and reuse
    assert preempting["preemptions"] > 0
    for result in single + leader:
        start, end = result["free_blocks"]
        assert end == start
    # Followers keep no block state; they ran exactly rank 0's steps, engine by engine, and stopped cleanly.
    assert [r["steps"] for r in follower] == [r["steps"] for r in leader] and all(r["steps"] for r in leader)


# -- the rank environment ---------------------------------------------------------------------------------------


def test_torchrun_environment_is_read_first():
    env = read_rank_environment(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "1234", "OMPI_COMM_WORLD_RANK": "0"}
    )
    assert env is not None
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.master_port) == ("torchrun", 1, 2, 1, 1234)


@pytest.mark.parametrize(
    "variables, launcher",
    [
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, "Open MPI"),
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, "PMI"),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3"}, "Slurm"),
    ],
)
def test_other_launchers(variables, launcher):
    env = read_rank_environment(variables)
    assert env is not None and (env.launcher, env.rank, env.world_size, env.local_rank) == (launcher, 3, 4, 3)


def test_no_launcher_is_a_single_process():
    assert read_rank_environment({"PATH": "/bin"}) is None


@pytest.mark.parametrize(
    "variables, named",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "-1"}, "SLURM_LOCALID must be >= 0"),
    ],
)
def test_bad_values_name_their_variable(variables, named):
    with pytest.raises(ConfigError, match=named):
        read_rank_environment(variables)


def test_world_size_must_equal_tensor_parallel_size():
    env = read_rank_environment({"RANK": "0", "WORLD_SIZE": "4"})
    assert env is not None
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 but the torchrun environment has 4 rank"):
        env.require_world_size(2)


# -- sharding rules ---------------------------------------------------------------------------------------------


def model_config(**overrides) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128,
    }
    return ModelConfig.from_dict({**raw, **overrides})


def test_column_row_and_vocabulary_slices():
    plan = ShardPlan.of(model_config(), rank=1, size=2)
    layer = "model.layers.0."
    assert plan.slice_of(layer + "self_attn.q_proj.weight") == TensorSlice(0, 32, 32)  # heads 4-7 of 8, x 8
    assert plan.slice_of(layer + "self_attn.k_proj.bias") == TensorSlice(0, 8, 8)  # KV head 1
    assert plan.slice_of(layer + "self_attn.o_proj.weight") == TensorSlice(1, 32, 32)
    assert plan.slice_of(layer + "mlp.up_proj.weight") == TensorSlice(0, 80, 80)
    assert plan.slice_of(layer + "mlp.down_proj.weight") == TensorSlice(1, 80, 80)
    assert plan.slice_of(layer + "mlp.down_proj.bias") == TensorSlice(0, 0, 0, zero=True)  # added on rank 0 only
    assert ShardPlan.of(model_config(), 0, 2).slice_of(layer + "self_attn.o_proj.bias") is None
    assert plan.slice_of("model.embed_tokens.weight") == TensorSlice(0, 500, 500)
    assert plan.slice_of("lm_head.weight") == TensorSlice(0, 500, 500)
    assert plan.slice_of(layer + "input_layernorm.weight") is None


def test_fewer_kv_heads_than_ranks_keep_the_head_their_queries_read():
    config = model_config(num_key_value_heads=2)
    firsts = [ShardPlan.of(config, rank, 4).first_kv_head for rank in range(4)]
    assert firsts == [0, 0, 1, 1]
    assert ShardPlan.of(config, 3, 4).num_kv_heads == 1
    assert ShardPlan.of(config, 3, 4).slice_of("model.layers.1.self_attn.v_proj.weight") == TensorSlice(0, 8, 8)


@pytest.mark.parametrize(
    "overrides, size, named",
    [
        ({"vocab_size": 1001}, 2, "vocab_size"),
        ({"intermediate_size": 161}, 2, "intermediate_size"),
        ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "num_attention_heads"),
        ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4, "num_key_value_heads"),
        ({"num_attention_heads": 12, "num_key_value_heads": 6}, 4, "num_key_value_heads"),
    ],
)
def test_sizes_that_do_not_divide_are_refused(overrides, size, named):
    with pytest.raises(ConfigError, match=named):
        ShardPlan.of(model_config(**overrides), 0, size)


# -- what tensor parallelism refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"quant_config": {"quant_algo": "FP8"}}, "quantization"),
        ({"kv_cache_config": {"dtype": "fp8"}}, "FP8 KV cache"),
    ],
)
def test_features_outside_this_slice_are_refused_by_name(extra, named):
    config = EngineConfig.from_dict({"model": "m", "tensor_parallel_size": 2, **extra})
    assert any(named in problem for problem in config.embedded_unsupported())


def test_what_pipeline_parallelism_refuses_besides():
    config = EngineConfig.from_dict({"model": "m", "pipeline_parallel_size": 2, "enable_lora": True})
    assert config.world_size == 2 and config.embedded_unsupported() == []
    medusa = {"decoding_type": "Medusa", "speculative_model_dir": "d"}
    with_tp = EngineConfig.from_dict(
        {"model": "m", "tensor_parallel_size": 2, "enable_lora": True, "speculative_config": medusa}
    )
    assert with_tp.embedded_unsupported() == []
    staged = EngineConfig.from_dict({"model": "m", "pipeline_parallel_size": 2, "speculative_config": medusa})
    assert any("with Medusa or Eagle (tensor parallelism alone" in p for p in staged.embedded_unsupported())
    assert EngineConfig.from_dict({"model": "m", "pipeline_parallel_size": 2}).embedded_unsupported() == []


def test_tensor_parallel_without_a_launcher_is_refused(tiny, monkeypatch):
    from tritonllm.engine.embedded.engine_core import EngineCore

    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    with pytest.raises(ConfigError, match="no launcher environment"):
        EngineCore(EngineConfig.from_dict({"model": str(tiny), "device": "cpu", "tensor_parallel_size": 2}))


class SecondOfTwoRanks:
    """What load_sharded reads of a group (the collectives are only installed, never called here)."""

    tp_rank, tp_size, device = 1, 2, torch.device("cpu")
    layout = ParallelLayout(tensor=2, pipeline=1, rank=1)


def test_a_rank_holds_exactly_its_slices(tiny):
    from safetensors.torch import load_file

    from tritonllm.engine.embedded.parallel.sharded_load import load_sharded

    model, full = load_sharded(tiny, torch.float32, torch.device("cpu"), SecondOfTwoRanks())  # type: ignore[arg-type]
    plan, slots = ShardPlan.of(full, 1, 2), model.checkpoint_slots()
    checked = 0
    for name, tensor in load_file(tiny / "model.safetensors").items():
        if name not in slots:  # a tied head's saved copy
            continue
        part, slot = plan.slice_of(name), slots[name]
        if part is None:
            expected = tensor
        elif part.zero:
            expected = torch.zeros(slot.shape)
        else:
            expected = tensor.narrow(part.dim, part.start, part.length)
        assert torch.equal(slot.param.narrow(0, slot.start, slot.shape[0]), expected), name
        checked += 1
    assert checked == len(slots)


@pytest.mark.parametrize("raw, named", [("soon", "must be a number of seconds"), ("0", "must be > 0")])
def test_a_bad_step_timeout_names_its_variable(raw, named):
    from tritonllm.engine.embedded.parallel.step_watch import step_timeout

    assert step_timeout({}) == 300 and step_timeout({"TRITONLLM_STEP_TIMEOUT_S": "2.5"}) == 2.5
    with pytest.raises(ConfigError, match=f"TRITONLLM_STEP_TIMEOUT_S {named}"):
        step_timeout({"TRITONLLM_STEP_TIMEOUT_S": raw})


def test_the_drafters_whole_embedding_and_head(tiny, tmp_path):
    """Read whole from the checkpoint (the embedding's when tied), random under dummy weights; a checkpoint
    without them names what it lacks."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tritonllm.engine.embedded.parallel.whole_ends import load_whole_ends

    config = ModelConfig.from_dict(json.loads((tiny / "config.json").read_text()))
    ends = load_whole_ends(tiny, config, torch.float32, torch.device("cpu"), "auto")
    weights = load_file(str(tiny / "model.safetensors"))
    assert torch.equal(ends.embedding, weights["model.embed_tokens.weight"])
    assert torch.equal(ends.output_weight, weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))
    ids = torch.tensor([0, 5, config.vocab_size - 1])
    assert torch.equal(ends.embed_tokens(ids), ends.embedding[ids])
    assert ends.compute_logits(ends.embedding[ids]).shape == (3, config.vocab_size)
    dummy = load_whole_ends(tiny, config, torch.float32, torch.device("cpu"), "dummy")
    assert dummy.embedding.shape == (config.vocab_size, config.hidden_size)
    assert (dummy.output_weight is dummy.embedding) == config.tie_word_embeddings
    shutil.copy(tiny / "config.json", tmp_path / "config.json")
    save_file({k: v for k, v in weights.items() if "embed_tokens" not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no model.embed_tokens.weight"):
        load_whole_ends(tmp_path, config, torch.float32, torch.device("cpu"), "auto")
