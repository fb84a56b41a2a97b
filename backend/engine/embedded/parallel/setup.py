"""What the engine core asks of tensor and pipeline parallelism: join the group its environment names, load this
rank's part of the model (its stage's layers, its tensor shard), agree on one KV cache size, pick the leader's or a
follower's runner, and stop the followers at shutdown.

CUDA graphs and the overlap scheduler are off under parallelism: a graph would capture the collectives and an
overlapped step would run ahead of the followers' plans (neither is built for it yet)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping, Optional

import torch

from tritonllm.lora.layers import WHOLE, LoraSharding

from ...config import ConfigError, EngineConfig
from ..network.llama import LlamaForCausalLM
from ..network.model_config import ModelConfig
from .environment import read_rank_environment
from .group import ParallelGroup, group_broken, join_group
from .layout import ParallelLayout
from .lora_shards import TensorParallelLora
from .sharded_load import load_sharded
from .sharding import ShardPlan
from .step_sync import FollowerRunner, LeaderRunner
from .whole_ends import WholeEnds, load_whole_ends

log = logging.getLogger("tritonllm.engine")


class Parallel:
    def __init__(self, group: ParallelGroup):
        self.group = group
        self.local_config: Optional[ModelConfig] = None
        self.full_config: Optional[ModelConfig] = None

    @classmethod
    def start(
        cls, config: EngineConfig, device: torch.device, environ: Optional[Mapping[str, str]] = None
    ) -> "Parallel":
        env = read_rank_environment(os.environ if environ is None else environ)
        if env is None:
            raise ConfigError(
                f"{config.parallel_layout()} but no launcher environment was found (RANK / WORLD_SIZE from "
                "torchrun, OMPI_COMM_WORLD_*, PMI_* or SLURM_*): start one process per rank"
            )
        env.require_world_size(config.tensor_parallel_size, config.pipeline_parallel_size)
        layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size, env.rank)
        return cls(join_group(env, device, layout))

    @property
    def is_leader(self) -> bool:
        return self.group.rank == 0

    @property
    def device(self) -> torch.device:
        return self.group.device

    @staticmethod
    def adjusted(config: EngineConfig) -> EngineConfig:
        """`config` with CUDA graphs and the overlap scheduler off (logged once)."""
        log.info("parallel: CUDA graphs and the overlap scheduler are off")
        return dataclasses.replace(config, cuda_graph_config=None, disable_overlap_scheduler=True)

    def load(self, model_dir: str, dtype: torch.dtype, load_format: str) -> tuple[LlamaForCausalLM, ModelConfig]:
        model, full = load_sharded(model_dir, dtype, self.device, self.group, load_format)
        self.local_config, self.full_config = model.config, full
        return model, full

    def whole_ends(self, model_dir: str, dtype: torch.dtype, load_format: str) -> WholeEnds:
        """The target's embedding and head, whole, for a drafter on this rank (whole_ends.py)."""
        assert self.full_config is not None, "load the model first"
        return load_whole_ends(model_dir, self.full_config, dtype, self.device, load_format)

    def lora_sharding(self, full: ModelConfig) -> LoraSharding:
        """The part of each LoRA adapter this rank's slots hold: its tensor shard's (lora_shards.py)."""
        if self.group.tp_size == 1:
            return WHOLE
        return TensorParallelLora(ShardPlan.of(full, self.group.tp_rank, self.group.tp_size), self.group)

    def local_layers(self, num_layers: int) -> range:
        """The layers of this rank's pipeline stage (all of them with one stage)."""
        return self.group.layout.layers(num_layers)

    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank holds."""
        assert self.local_config is not None, "load the model first"
        return self.local_config.num_heads, self.local_config.num_kv_heads

    def agree_num_blocks(self, num_blocks: int) -> int:
        """One KV cache size on every rank (the smallest: free memory differs between devices)."""
        return self.group.min_over_ranks(num_blocks)

    def runner_class(self) -> type:
        return LeaderRunner if self.is_leader else FollowerRunner

    def stop_followers(self, runner) -> None:
        if self.is_leader and group_broken() is None:  # followers of a broken group have stopped on their own
            runner.stop_followers()
