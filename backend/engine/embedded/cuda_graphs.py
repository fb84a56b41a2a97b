"""CUDA graphs for decode-only steps (`cuda_graph_config`, as in TensorRT-LLM's PyTorch backend).

A decode step of a small model on a GPU is bound by kernel launches and Python, not by the GPU: the forward is
hundreds of small kernels. Replaying it as one captured graph removes that cost. A graph needs fixed shapes, so
there is one per (batch size, KV blocks a row) pair: batch sizes come from the settings (a batch runs in the graph
of its exact size, or with `enable_padding` of the next larger one), block widths are rounded up to a power of two
(attention masks the extra blocks). Graphs are captured the first time their shape comes up, and share one memory
pool. Padding rows write their K/V into a scratch block that belongs to no sequence.

Only plain decode steps use graphs: steps with prompt tokens, speculative drafts or LoRA adapters run eagerly."""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from tritonllm.engine.graph_settings import CudaGraphSettings

from .attention import AttentionMetadata

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on a side stream before capture (lets lazy initialisation happen outside the graph)


def graphs_supported(device: torch.device) -> bool:
    """CUDA graphs exist on CUDA devices only; elsewhere `cuda_graph_config` has nothing to do."""
    return device.type == "cuda"


def capture(forward: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture `forward` as a CUDA graph; returns (replay, the output tensor each replay refills)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph.replay, output


class _Graph:
    """One captured forward: `batch` rows, `width` KV blocks a row, with static inputs it reads on every replay."""

    def __init__(self, batch: int, width: int, block_size: int, scratch_slot: int, dtype, device):
        long = dict(dtype=torch.long, device=device)
        self.scratch_slot = scratch_slot
        self.input_ids = torch.zeros(batch, **long)
        self.positions = torch.zeros(batch, **long)
        self.slots = torch.full((batch,), scratch_slot, **long)  # every row a padding row until loaded
        self.tables = torch.zeros(batch, width, **long)
        self.mask = torch.full((batch, 1, 1, width * block_size), float("-inf"), dtype=dtype, device=device)
        self.mask[..., 0] = 0  # a padding row sees one key, so its softmax stays finite
        self.attn = AttentionMetadata(slot_mapping=self.slots, block_tables=self.tables,
                                      query_starts=list(range(batch)), query_lens=[1] * batch,
                                      context_lens=[1] * batch, block_size=block_size, decode_mask=self.mask)
        self.replay: Optional[Callable[[], None]] = None
        self.hidden: Optional[torch.Tensor] = None

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """This step's rows first; the rest become padding rows again (their slots point at the scratch block;
        stale block ids and masks of earlier steps stay, valid and harmless)."""
        rows, columns = len(input_ids), attn.block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slots[:rows].copy_(attn.slot_mapping)
        self.slots[rows:].fill_(self.scratch_slot)
        self.tables[:rows, :columns].copy_(attn.block_tables)
        width = attn.decode_mask.shape[-1]
        self.mask[:rows, ..., :width].copy_(attn.decode_mask)
        self.mask[:rows, ..., width:].fill_(float("-inf"))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, settings: CudaGraphSettings, max_batch_size: int,
                 block_size: int, max_blocks_per_seq: int, scratch_block: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.settings = settings
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self.max_width = max_blocks_per_seq
        self.scratch_slot = scratch_block * block_size
        self.device = device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> Optional[torch.Tensor]:
        """Final-norm hidden states [rows, hidden] from a graph, or None where no graph applies (run eagerly)."""
        rows = len(input_ids)
        if not attn.is_decode_only or rows > self.max_batch_size:
            return None
        batch = self.settings.graph_batch_size(rows)
        if batch is None:
            return None
        graph = self._graph(batch, self._width(attn.block_tables.shape[1]))
        graph.load(input_ids, positions, attn)
        graph.replay()
        self.replays += 1
        return graph.hidden[:rows]

    def _width(self, blocks: int) -> int:
        return min(self.max_width, 1 << max(0, blocks - 1).bit_length())

    def _graph(self, batch: int, width: int) -> _Graph:
        graph = self.graphs.get((batch, width))
        if graph is None:
            started = time.perf_counter()
            graph = _Graph(batch, width, self.block_size, self.scratch_slot, self.kv_caches[0][0].dtype, self.device)
            graph.replay, graph.hidden = capture(
                lambda: self.model(graph.input_ids, graph.positions, graph.attn, self.kv_caches), self.pool)
            self.graphs[(batch, width)] = graph
            log.debug("captured a CUDA graph for decode batches of %d, up to %d cached tokens a row (%.0f ms)",
                      batch, width * self.block_size, (time.perf_counter() - started) * 1e3)
        return graph
