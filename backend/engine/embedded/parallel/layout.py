"""Where a rank sits among tensor_parallel_size x pipeline_parallel_size ranks, and which layers each stage runs.

As TensorRT-LLM maps them: rank = stage * tensor_parallel_size + tensor rank, so a stage's ranks are neighbours
(one host's GPUs in a multi-host pipeline) and rank 0, the leader, is the first stage's first tensor rank."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    tensor: int  # ranks that split each layer (tensor_parallel_size)
    pipeline: int  # stages that split the layers (pipeline_parallel_size)
    rank: int  # this process's rank in the world of tensor x pipeline ranks

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def stage(self) -> int:
        return self.rank // self.tensor

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline - 1

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tensor + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, t) for t in range(self.tensor)]

    @property
    def previous_rank(self) -> int:
        """The rank whose hidden states this rank receives: the same tensor rank of the stage before."""
        return self.rank_of(self.stage - 1, self.tp_rank)

    @property
    def next_rank(self) -> int:
        return self.rank_of(self.stage + 1, self.tp_rank)

    @property
    def logits_rank(self) -> int:
        """The rank that hands each step's logits to rank 0: the last stage's first tensor rank."""
        return self.rank_of(self.pipeline - 1, 0)

    def layers(self, num_layers: int) -> range:
        """This rank's stage's layers (stage_layers)."""
        return stage_layers(num_layers, self.pipeline)[self.stage]


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Consecutive layers per stage, as even as possible; the first stages take one more where they do not divide
    (the last stage also runs the output head)."""
    if stages > num_layers:
        raise ConfigError(
            f"pipeline_parallel_size={stages} is more than the model's {num_layers} layers (each stage needs one)"
        )
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        end = start + base + (stage < extra)
        ranges.append(range(start, end))
        start = end
    return ranges
