"""A step's small integer arrays (token ids, positions, slots, block tables, kernel metadata) sent to the device in
one copy: packed into one pinned host buffer, copied without blocking the host, then viewed back by name.

Every `torch.tensor(list, device="cuda")` is a copy that makes the host wait for the GPU; a step that made a few
of them waited for the previous step's work each time. On CPU the arrays are used in place, with no copy."""

from __future__ import annotations

import numpy as np
import torch


class HostArrays:
    """Named integer arrays collected on the host, then `upload`ed together: int64 ones (what torch indexes with)
    and int32 ones (what the kernels read), the latter converted on the device in one go."""

    def __init__(self) -> None:
        self._long: list[tuple[str, np.ndarray]] = []
        self._int32: list[tuple[str, np.ndarray]] = []

    def add(self, name: str, values, int32: bool = False) -> None:
        """`values`: a list or array of ints, any shape."""
        (self._int32 if int32 else self._long).append((name, np.asarray(values, dtype=np.int64)))

    @staticmethod
    def one(values, device: torch.device) -> torch.Tensor:
        """A single int64 array on `device`, copied without blocking the host."""
        host = HostArrays()
        host.add("values", values)
        return host.upload(device)["values"]

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Each array as a tensor on `device`, with its shape; one host-to-device copy in all."""
        parts = self._long + self._int32
        if not parts:
            return {}
        sizes = [_padded_size(array) for _, array in parts]
        # written in place into one (pinned, on CUDA) buffer: np.pad and np.concatenate cost ~20 us an array
        packed = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
        flat, offset = packed.numpy(), 0
        for (_, array), size in zip(parts, sizes):
            flat[offset : offset + array.size] = array.reshape(-1)
            flat[offset + array.size : offset + size] = 0
            offset += size
        if device.type == "cuda":
            packed = packed.to(device, non_blocking=True)
        split = sum(sizes[: len(self._long)])
        views = _views(packed[:split], self._long)
        views.update(_views(packed[split:].to(torch.int32), self._int32))
        return views


# Every array starts on a multiple of ALIGN elements (16 bytes at least): Triton compiles a kernel variant per
# pointer alignment, and arrays at arbitrary offsets would make new variants appear mid-run.
ALIGN = 4


def _padded_size(array: np.ndarray) -> int:
    return -(-array.size // ALIGN) * ALIGN


def _views(flat: torch.Tensor, parts: list[tuple[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    views, offset = {}, 0
    for name, array in parts:
        views[name] = flat[offset : offset + array.size].view(array.shape)
        offset += _padded_size(array)
    return views


def padded_rows(rows: list[list[int]], width: int) -> np.ndarray:
    """[len(rows), width] int64: each row cut or padded with 0 to `width` (block tables)."""
    table = np.zeros((len(rows), width), dtype=np.int64)
    for index, row in enumerate(rows):
        used = min(len(row), width)
        table[index, :used] = row[:used]
    return table
