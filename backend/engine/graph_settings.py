"""`cuda_graph_config` (TensorRT-LLM's `CudaGraphConfig`): which decode batch sizes get a CUDA graph.

Keys as in TensorRT-LLM: `batch_sizes` (the sizes that get a graph), `max_batch_size` (without `batch_sizes`: sizes
are generated up to it; with them it must equal their largest) and `enable_padding` (a batch runs
in the graph of the next larger size; without it only batches of exactly a listed size use graphs). None turns
graphs off. One default differs: the embedded engine pads unless told `enable_padding: false` (TensorRT-LLM does
not): it captures each graph on first use, and without padding a batch that shrinks request by request meets a new
shape at every size (docs/benchmarks.md: unpadded, a short mixed workload spent more on captures than graphs saved).
A second: without either size key, graphs go up to the engine's own `max_batch_size` where TensorRT-LLM stops at
128 (larger batches would decode eagerly, several times slower on a GPU); above 128, padded sizes step by 64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_MAX_BATCH_SIZE = 128
KEYS = ("batch_sizes", "max_batch_size", "enable_padding")


class GraphSettingsError(ValueError):
    pass


@dataclass(frozen=True)
class CudaGraphSettings:
    batch_sizes: tuple[int, ...]  # ascending
    enable_padding: bool = False

    def graph_batch_size(self, num_rows: int) -> Optional[int]:
        """The graph a batch of `num_rows` runs in, or None (run it eagerly)."""
        if self.enable_padding:
            return next((size for size in self.batch_sizes if size >= num_rows), None)
        return num_rows if num_rows in self.batch_sizes else None


def parse_cuda_graph_config(
    value: Any, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
) -> Optional[CudaGraphSettings]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise GraphSettingsError(f"cuda_graph_config must be a mapping or null, got {value!r}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise GraphSettingsError(f"cuda_graph_config: unknown key(s) {unknown}; known: {list(KEYS)}")
    padding = value.get("enable_padding", True)
    if not isinstance(padding, bool):
        raise GraphSettingsError(f"cuda_graph_config.enable_padding must be true or false, got {padding!r}")
    limit = value.get("max_batch_size", 0)
    if not _is_count(limit, minimum=0):
        raise GraphSettingsError(f"cuda_graph_config.max_batch_size must be an integer >= 0, got {limit!r}")
    sizes = value.get("batch_sizes")
    if sizes is None:
        return CudaGraphSettings(default_batch_sizes(limit or default_max_batch_size, padding), padding)
    if not isinstance(sizes, list) or not sizes or not all(_is_count(size, minimum=1) for size in sizes):
        raise GraphSettingsError(
            f"cuda_graph_config.batch_sizes must be a non-empty list of integers >= 1, got {sizes!r}"
        )
    if limit and limit != max(sizes):
        raise GraphSettingsError(
            f"cuda_graph_config.max_batch_size={limit} must equal the largest of batch_sizes "
            f"({max(sizes)}) when both are given"
        )
    return CudaGraphSettings(tuple(sorted(set(sizes))), padding)


def default_batch_sizes(max_batch_size: int, padding: bool) -> tuple[int, ...]:
    """With padding, few sizes (a batch rounds up to the next: steps of 8 to 128, then of 64); without, every size
    to 31, then powers of two; `max_batch_size` itself always."""
    if padding:
        sizes = [1, 2, 4, *range(8, 129, 8), *range(192, max_batch_size, 64)]
    else:
        sizes = [*range(1, 32), 32, 64, 128]
        power = 256
        while power < max_batch_size:
            sizes.append(power)
            power *= 2
    return tuple(sorted({size for size in sizes if size < max_batch_size} | {max_batch_size}))


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
