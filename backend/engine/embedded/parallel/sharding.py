"""Which slice of each checkpoint tensor a rank holds (Megatron-style splits).

Column-parallel (split by output rows of the weight): q/k/v and gate/up, biases with them. Row-parallel (split by
input columns, the outputs then summed over ranks): o_proj and down_proj; their biases are loaded on rank 0 only
(zeros elsewhere), so the sum adds them once. Embedding and LM head are split over the vocabulary, which must divide
evenly (no padding). KV heads split evenly, or, when there are fewer KV heads than ranks, each rank keeps the one KV
head its query heads use (the rank count must then be a multiple of the KV heads). Norms are replicated."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

from ...config import ConfigError
from ..network.model_config import ModelConfig

# name suffix -> (kind, dim): kind says which range of the dimension a rank takes
_RULES = (
    (re.compile(r"self_attn\.q_proj\.(weight|bias)$"), "q", 0),
    (re.compile(r"self_attn\.[kv]_proj\.(weight|bias)$"), "kv", 0),
    (re.compile(r"self_attn\.o_proj\.weight$"), "q", 1),
    (re.compile(r"mlp\.(gate|up)_proj\.(weight|bias)$"), "mlp", 0),
    (re.compile(r"mlp\.down_proj\.weight$"), "mlp", 1),
    (re.compile(r"(self_attn\.o_proj|mlp\.down_proj)\.bias$"), "once", 0),
    (re.compile(r"(embed_tokens|lm_head)\.weight$"), "vocab", 0),
)


@dataclass(frozen=True)
class TensorSlice:
    """Rows (dim 0) or columns (dim 1) `start : start + length` of a checkpoint tensor; `zero`: load zeros instead
    (a row-parallel bias off rank 0)."""

    dim: int
    start: int
    length: int
    zero: bool = False


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    full: ModelConfig

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> "ShardPlan":
        check_divisible(config, size)
        return cls(rank, size, config)

    @property
    def num_heads(self) -> int:
        return self.full.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.full.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank keeps: the one its first query head reads."""
        group = self.full.num_heads // self.full.num_kv_heads  # query heads per KV head
        return (self.rank * self.num_heads) // group

    @property
    def intermediate_size(self) -> int:
        return self.full.intermediate_size // self.size

    @property
    def vocab_size(self) -> int:
        return self.full.vocab_size // self.size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size

    def local_config(self) -> ModelConfig:
        """The shapes of this rank's model: its heads, KV heads, MLP width and vocabulary slice."""
        return dataclasses.replace(
            self.full,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
        )

    def slice_of(self, name: str) -> Optional[TensorSlice]:
        """This rank's slice of checkpoint tensor `name`; None: the whole tensor (replicated)."""
        head_dim = self.full.head_dim
        for pattern, kind, dim in _RULES:
            if not pattern.search(name):
                continue
            if kind == "q":
                return TensorSlice(dim, self.rank * self.num_heads * head_dim, self.num_heads * head_dim)
            if kind == "kv":
                return TensorSlice(dim, self.first_kv_head * head_dim, self.num_kv_heads * head_dim)
            if kind == "mlp":
                return TensorSlice(dim, self.rank * self.intermediate_size, self.intermediate_size)
            if kind == "vocab":
                return TensorSlice(dim, self.vocab_start, self.vocab_size)
            return None if self.rank == 0 else TensorSlice(0, 0, 0, zero=True)
        return None


def check_divisible(config: ModelConfig, size: int) -> None:
    """ConfigError naming the first size that tensor_parallel_size does not split evenly."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    for name, value in (
        ("num_attention_heads", heads),
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
    ):
        if value % size:
            raise ConfigError(f"tensor_parallel_size={size} does not divide the model's {name} ({value})")
    if kv_heads >= size and kv_heads % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the model's num_key_value_heads ({kv_heads})")
    if kv_heads < size and size % kv_heads:
        raise ConfigError(
            f"tensor_parallel_size={size} is not a multiple of the model's num_key_value_heads ({kv_heads}), so the "
            "KV heads cannot be replicated evenly"
        )
