"""Launching the parallel tests' ranks (tp_worker.py under torchrun's variables) and their tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tritonllm.checkpoints.tiny import build_tiny_model, random_weights
from tritonllm.deploy.tritonserver import free_port

WORKER = Path(__file__).with_name("tp_worker.py")


def one_kv_head_llama(out: Path) -> Path:
    """The tiny Llama with a single KV head (fewer KV heads than ranks: each rank keeps it) and a bias on every
    projection (the builder's Llama has none): o_proj's and down_proj's are the row-parallel ones, added once."""
    model_dir = build_tiny_model(out, seed=3, arch="llama")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    weights = random_weights(config, 3)
    generator = torch.Generator().manual_seed(4)
    for name, tensor in list(weights.items()):
        if name.endswith(("o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            bias = torch.randn(tensor.shape[0], generator=generator) * 0.5
            weights[name.replace(".weight", ".bias")] = bias
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def start_ranks(model_dir: Path, out: Path, *extra: str, world_size: int = 2, pipeline: int = 1) -> list:
    """tp_worker.py as `world_size` ranks (`pipeline` stages of world_size / pipeline tensor ranks)."""
    port, procs = free_port(), []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env["TP_WORKER_PIPELINE"] = str(pipeline)
        cmd = [sys.executable, str(WORKER), str(model_dir), str(out / f"rank{rank}.json"), *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def launch(model_dir: Path, out: Path, world_size: int = 2, pipeline: int = 1) -> list:
    """Run tp_worker.py as `world_size` ranks with torchrun's variables; every rank's JSON result."""
    procs = start_ranks(model_dir, out, world_size=world_size, pipeline=pipeline)
    try:
        for rank, proc in enumerate(procs):
            output, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"
    finally:  # a failed leader leaves its followers waiting for the next step
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def peft_adapters(model_dir: Path, out: Path) -> list[Path]:
    """Three PEFT adapters of `model_dir` for the LoRA scenario (tp_worker.LORA_PLAN): every module at rank 4, q/v
    at rank 2, the MLP at rank 4."""
    from ..lora.conftest import make_peft_adapter

    targets = [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["q_proj", "v_proj"]]
    targets.append(["gate_proj", "up_proj", "down_proj"])
    return [
        make_peft_adapter(model_dir, out / f"a{i}", t, rank=4 if i != 1 else 2, seed=i, scale=3.0)
        for i, t in enumerate(targets)
    ]


def assert_adapters_changed_their_requests(lora: dict) -> None:
    """The LoRA scenario's adapted requests differ from the base model's, the others do not."""
    from .tp_worker import LORA_PLAN

    for adapter, adapted, base in zip(LORA_PLAN, lora["tokens"], lora["base_tokens"], strict=True):
        assert (adapted == base) == (adapter is None)
