"""CUDA graphs for decode steps (`cuda_graph_config`, as in TensorRT-LLM's PyTorch backend).

A decode step of a small model on a GPU is bound by kernel launches and Python, not by the GPU: the forward is
hundreds of small kernels. Replaying it as one captured graph removes that cost. A graph needs fixed shapes, so
one is captured, on first use, per (sequences, query rows a sequence, KV blocks a sequence): sequences come from
the settings (a batch runs in the graph of its exact size, or with `enable_padding` of the next larger one); rows
are rounded up to a power of two, so speculative steps (a root and its draft tree) run in graphs too, padded; block
widths are rounded up to a power of two of at least MIN_GRAPH_TOKENS (attention masks the extra keys). Graphs share
one memory pool. Padding rows write their K/V into a scratch block that belongs to no sequence.

Short prompts run in graphs too: a step whose longest query is over MAX_GRAPH_ROWS tokens (a prompt) takes a graph
while its padded rows are at most PROMPT_GRAPH_ROWS (one prompt of up to 256 tokens, say), since an eager prefill
of a few hundred tokens is bound by launching its kernels (a 128-token prefill of Llama-3.1-8B's shape: ~6 ms of
GPU work, 16-50 ms eager). Longer prompts, steps with LoRA adapters, or steps that padding would swell
(MAX_PADDING) run eagerly."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

from tritonllm.engine.graph_settings import CudaGraphSettings

from .attention import AttentionMetadata
from .host_arrays import HostArrays

log = logging.getLogger(__name__)

MIN_GRAPH_TOKENS = 1024  # the narrowest KV a graph reads a sequence: fewer shapes, and a GPU gathers it cheaply
MAX_GRAPH_ROWS = 32  # the most new tokens of a sequence in a graph of any size (a root and its draft tree)
PROMPT_GRAPH_ROWS = 256  # the most rows (sequences x rows a sequence) of a graph for longer queries (prompts)
# Padding must not multiply the work: a graph runs a step only if its rows are at most MAX_PADDING times the step's
# tokens, or SMALL_GRAPH_ROWS (one short prompt among many decodes pads every decode to the prompt's length).
MAX_PADDING = 4
SMALL_GRAPH_ROWS = 256
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
    """One captured forward over `seqs` x `rows` query rows and `width` KV blocks a sequence, with the static inputs
    it reads on every replay (row r of sequence s is flat row s * rows + r)."""

    def __init__(self, seqs: int, rows: int, width: int, block_size: int, scratch_slot: int, dtype, device):
        long = dict(dtype=torch.long, device=device)
        self.scratch_slot = scratch_slot
        self.input_ids = torch.zeros(seqs * rows, **long)
        self.positions = torch.zeros(seqs * rows, **long)
        self.slots = torch.full((seqs * rows,), scratch_slot, **long)  # every row a padding row until loaded
        self.tables = torch.zeros(seqs, width, **long)
        self.mask = torch.full((seqs, 1, rows, width * block_size), float("-inf"), dtype=dtype, device=device)
        self.mask[..., 0] = 0  # a padding row sees one key, so its softmax stays finite
        self.attn = AttentionMetadata(
            slot_mapping=self.slots,
            block_tables=self.tables,
            query_starts=list(range(0, seqs * rows, rows)),
            query_lens=[rows] * seqs,
            context_lens=[1] * seqs,
            block_size=block_size,
            decode_mask=self.mask,
            positions=self.positions,
        )
        self.replay: Optional[Callable[[], None]] = None
        self.hidden: Optional[torch.Tensor] = None

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        placement: Optional[torch.Tensor],
        visible: torch.Tensor,
    ) -> None:
        """This step's rows at their `placement`; every other row becomes a padding row (its slot the scratch
        block's; stale ids, block ids and masks of earlier steps stay, valid and harmless)."""
        seqs = _load_rows(self, input_ids, positions, attn, placement)
        mask = self.mask[:seqs, 0]
        mask.fill_(float("-inf"))
        mask.masked_fill_(visible.to(mask.device), 0.0)


class _KernelGraph:
    """The Triton backend's graph over `seqs` x `rows` query rows: no masks; the kernels read each sequence's length,
    block table and (rows > 1) query count and draft tree from static buffers. Every sequence's block table is as
    wide as the longest sequence's can be (the kernels read only up to its length), so one graph serves all
    lengths. Padding sequences have length 1 and no queries; padding rows come out as zeros."""

    def __init__(self, seqs: int, rows: int, max_width: int, block_size: int, scratch_slot: int, kernels, device):
        from .attention.triton_backend import KernelMetadata

        long, int32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.scratch_slot, self.rows = scratch_slot, rows
        self.input_ids = torch.zeros(seqs * rows, **long)
        self.positions = torch.zeros(seqs * rows, **long)
        self.slots = torch.full((seqs * rows,), scratch_slot, **long)
        self.tables = torch.zeros(seqs, max_width, **int32)
        self.seq_lens = torch.ones(seqs, **int32)
        kernel = KernelMetadata(
            self.slots, self.tables, self.seq_lens, max_width * block_size, decode=rows == 1, positions=self.positions
        )
        if rows > 1:
            self._add_query_buffers(kernel, seqs, rows, kernels, device)
        self.attn = AttentionMetadata(
            slot_mapping=self.slots,
            block_tables=self.tables,
            query_starts=list(range(0, seqs * rows, rows)),
            query_lens=[rows] * seqs,
            context_lens=[1] * seqs,
            block_size=block_size,
            kernel=kernel,
            positions=self.positions,
        )
        self.replay: Optional[Callable[[], None]] = None
        self.hidden: Optional[torch.Tensor] = None

    def _add_query_buffers(self, kernel, seqs: int, rows: int, kernels, device) -> None:
        from .attention.triton_kernels import TreeMasks, prefill_tiles

        int32 = dict(dtype=torch.int32, device=device)
        self.query_lens = torch.zeros(seqs, **int32)
        self.tree_lens = torch.zeros(seqs, **int32)
        self.tree_masks = torch.zeros(seqs * rows * rows, dtype=torch.bool, device=device)
        tile_seqs, tile_starts = prefill_tiles(
            [rows] * seqs, kernels.num_heads, kernels.num_kv_heads, tokens_per_seq=rows
        )
        kernel.query_starts = torch.arange(0, seqs * rows, rows, **int32)
        kernel.query_lens = self.query_lens
        kernel.tiles = (torch.from_numpy(tile_seqs).to(device), torch.from_numpy(tile_starts).to(device))
        kernel.tree = TreeMasks(
            self.tree_lens, torch.arange(0, seqs * rows * rows, rows * rows, **int32), self.tree_masks
        )

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        placement: Optional[torch.Tensor],
    ) -> None:
        """This step's rows at their `placement`; the other rows and sequences become padding."""
        seqs = _load_rows(self, input_ids, positions, attn, placement)
        kernel = attn.kernel
        assert kernel is not None  # the step ran with the Triton backend's metadata, as this graph does
        _load_front(self.seq_lens, kernel.seq_lens, 1)  # padding sequences: length 1
        if self.rows > 1:
            assert kernel.query_lens is not None  # a sequence has several rows: not a decode-only step
            self.query_lens.zero_()
            self.query_lens[:seqs].copy_(kernel.query_lens)
            self._load_trees(attn, seqs)

    def _load_trees(self, attn: AttentionMetadata, seqs: int) -> None:
        self.tree_lens.zero_()
        if not attn.tail_masks:
            return
        rows = self.rows
        lens = np.zeros(seqs, dtype=np.int64)
        masks = np.zeros((seqs, rows * rows), dtype=bool)  # each tree's [n, n] mask row-major from its start
        for seq, tail in enumerate(attn.tail_masks):
            if tail is not None:
                lens[seq] = size = tail.shape[0]
                masks[seq, : size * size] = tail.reshape(-1).cpu().numpy()
        host = HostArrays()
        host.add("lens", lens, int32=True)
        host.add("masks", masks)
        arrays = host.upload(self.tree_lens.device)
        self.tree_lens[:seqs].copy_(arrays["lens"])
        self.tree_masks[: seqs * rows * rows].copy_(arrays["masks"].reshape(-1))


def _load_rows(
    graph, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, placement: Optional[torch.Tensor]
) -> int:
    """Either graph's ids, positions, slots (padding rows: the scratch slot) and block tables for this step;
    returns its number of sequences. placement None: the step's rows are the graph's first rows (decode)."""
    if placement is None:
        _load_front(graph.slots, attn.slot_mapping, graph.scratch_slot)
        _load_front(graph.input_ids, input_ids, None)  # a padding row's stale id is harmless
        _load_front(graph.positions, positions, 0)
    else:
        graph.slots.fill_(graph.scratch_slot)
        graph.slots.index_copy_(0, placement, attn.slot_mapping)
        graph.input_ids.index_copy_(0, placement, input_ids)
        graph.positions.zero_()  # padding rows at 0: a windowed layer still shows them key 0
        graph.positions.index_copy_(0, placement, positions)
    seqs, columns = attn.block_tables.shape
    graph.tables[:seqs, :columns].copy_(attn.block_tables)
    return seqs


def _load_front(buffer: torch.Tensor, values: torch.Tensor, padding: Optional[int]) -> None:
    """values into the buffer's first rows, the rows after them set to `padding` (None: left as they are): a
    decode step's two launches at most, where placement's fill and index copy took three."""
    count = values.shape[0]
    buffer[:count].copy_(values)
    if padding is not None and count < buffer.shape[0]:
        buffer[count:].fill_(padding)


def visible_keys(attn: AttentionMetadata, rows: int, width: int) -> torch.Tensor:
    """[S, rows, width] bool: the keys each padded query row sees. Row r < q of a sequence with q new tokens is
    causal over its context (its draft tree's rows see the tree's mask among themselves); padding rows see key 0."""
    queries, contexts = np.array(attn.query_lens)[:, None], np.array(attn.context_lens)[:, None]
    row = np.arange(rows)[None, :]
    newest = np.where(row < queries, contexts - queries + row, 0)  # [S, rows]: the last key a row sees
    visible = np.arange(width)[None, None, :] <= newest[:, :, None]
    for seq, tail in enumerate(attn.tail_masks or ()):
        if tail is not None:
            size, query, context = tail.shape[0], attn.query_lens[seq], attn.context_lens[seq]
            visible[seq, query - size : query, context - size : context] = tail.cpu().numpy()
    return torch.from_numpy(visible)


def placement(attn: AttentionMetadata, rows: int) -> np.ndarray:
    """Each flat query row's row in a graph of `rows` rows a sequence."""
    lens = np.array(attn.query_lens)
    shift = np.arange(len(lens)) * rows - np.array(attn.query_starts)
    return np.repeat(shift, lens) + np.arange(lens.sum())


def placement_on(attn: AttentionMetadata, rows: int, device: torch.device) -> Optional[torch.Tensor]:
    """`placement` as a device tensor; None for a decode step, whose rows stay where they are (the graph's first)."""
    if rows == 1:
        return None
    return HostArrays.one(placement(attn, rows), device)


def _power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        settings: CudaGraphSettings,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        device: torch.device,
        kernels=None,
        dtype: Optional[torch.dtype] = None,
    ):
        """`dtype`: the model's, which the portable backend's masks take; the caches' by default (an FP8 cache's
        is not one a mask can be in)."""
        self.model = model
        self.dtype = dtype
        self.kernels = kernels  # attention.triton_backend.TritonAttention, or None: the portable backend's graphs
        self.kv_caches = kv_caches
        self.settings = settings
        self.block_size = block_size
        self.max_width = max_blocks_per_seq
        self.min_width = min(max_blocks_per_seq, max(1, MIN_GRAPH_TOKENS // block_size))
        self.scratch_slot = scratch_block * block_size
        self.device = device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[tuple[int, int, int], _Graph | _KernelGraph] = {}
        self.replays = 0
        self.failed = False  # a capture failed: every step runs eagerly from then on

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> Optional[torch.Tensor]:
        """The model's output rows (final-norm hidden states, and any captured layers) from a graph, or None where
        no graph applies (run eagerly)."""
        shape = None if self.failed else self.graph_shape(attn.query_lens)
        if shape is None:
            return None
        seqs, rows = shape
        width = self._width(attn)
        graph = self._graph(seqs, rows, width)
        if graph is None:
            return None
        where = placement_on(attn, rows, self.device)
        if isinstance(graph, _Graph):  # the portable backend's (self.kernels is None)
            graph.load(input_ids, positions, attn, where, visible_keys(attn, rows, width * self.block_size))
        else:
            graph.load(input_ids, positions, attn, where)
        assert graph.replay is not None and graph.hidden is not None  # set when the graph was captured
        graph.replay()
        self.replays += 1
        if where is None:  # a copy: the graph's buffer is overwritten by the next replay
            return graph.hidden[: len(attn.query_lens)].clone()
        return graph.hidden.index_select(0, where)

    def graph_shape(self, query_lens: list[int]) -> Optional[tuple[int, int]]:
        """(sequences, rows a sequence) of the graph a step with these query lengths runs in, or None (eager)."""
        seqs = self.settings.graph_batch_size(len(query_lens))
        if seqs is None:
            return None
        longest, tokens = max(query_lens), sum(query_lens)
        rows = _power_of_two(longest)
        if longest > MAX_GRAPH_ROWS and seqs * rows > PROMPT_GRAPH_ROWS:
            return None
        if seqs * rows > max(MAX_PADDING * tokens, SMALL_GRAPH_ROWS):
            return None
        return seqs, rows

    def _width(self, attn: AttentionMetadata) -> int:
        """KV blocks a sequence in the graph: kernels take the widest table (they read only up to each length);
        masked attention reads the whole width, so it is the step's rounded up (fewer keys, more graphs)."""
        if self.kernels is not None:
            return self.max_width
        return min(self.max_width, max(self.min_width, _power_of_two(attn.block_tables.shape[1])))

    def _new_graph(self, seqs: int, rows: int, width: int) -> _Graph | _KernelGraph:
        if self.kernels is not None:
            return _KernelGraph(seqs, rows, width, self.block_size, self.scratch_slot, self.kernels, self.device)
        mask_dtype = self.dtype or self.kv_caches[0][0].dtype
        return _Graph(seqs, rows, width, self.block_size, self.scratch_slot, mask_dtype, self.device)

    def _graph(self, seqs: int, rows: int, width: int) -> Optional[_Graph | _KernelGraph]:
        """The graph of this shape, captured now if it is new; None if capturing fails (graphs are then given up
        for good, and the engine runs eagerly as it would without them)."""
        graph = self.graphs.get((seqs, rows, width))
        if graph is None:
            started = time.perf_counter()
            graph = self._new_graph(seqs, rows, width)
            try:
                graph.replay, graph.hidden = capture(
                    lambda: self.model(graph.input_ids, graph.positions, graph.attn, self.kv_caches), self.pool
                )
            except RuntimeError as error:
                log.warning("capturing a CUDA graph failed (%s); decode steps run without graphs from now on", error)
                self.failed = True
                return None
            self.graphs[(seqs, rows, width)] = graph
            log.debug(
                "captured a CUDA graph for %d sequences x %d rows, up to %d cached tokens a sequence (%.0f ms)",
                seqs,
                rows,
                width * self.block_size,
                (time.perf_counter() - started) * 1e3,
            )
        return graph
