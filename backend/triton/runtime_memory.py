"""Memory the model's process uses, for `nv_trt_llm_runtime_memory_metrics{memory_type=cpu|gpu|pinned}`.

TensorRT-LLM reports what its runtime allocated. The embedded engine has no allocator of its own, so the numbers
here are the closest honest equivalents (docs/metrics.md):

  cpu     resident memory of the model's process: on a CPU engine the weights and the touched KV cache live
          there, next to Python and torch themselves
  gpu     bytes torch has allocated on CUDA devices (weights, KV cache, activations); 0 without CUDA
  pinned  pinned host memory held by torch's caching host allocator; 0 without CUDA

Nothing here imports torch or initialises CUDA just to report 0: a metrics thread must not start a GPU context."""

from __future__ import annotations

import os
import sys


def runtime_memory() -> dict[str, int]:
    """Bytes in use, keyed by the label values of the memory_type label."""
    return {"cpu": resident_bytes(), "gpu": cuda_allocated_bytes(), "pinned": pinned_host_bytes()}


def resident_bytes() -> int:
    """Resident set size of this process (Linux /proc); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _initialised_torch_cuda():
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda


def cuda_allocated_bytes() -> int:
    cuda = _initialised_torch_cuda()
    if cuda is None:
        return 0
    return sum(cuda.memory_allocated(device) for device in range(cuda.device_count()))


def pinned_host_bytes() -> int:
    cuda = _initialised_torch_cuda()
    if cuda is None or not hasattr(cuda.memory, "host_memory_stats"):  # torch < 2.5 cannot say
        return 0
    try:
        return int(cuda.memory.host_memory_stats().get("allocated_bytes.current", 0))
    except RuntimeError:
        return 0
