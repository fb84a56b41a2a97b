"""Programmatic dependent launch (PDL) on Hopper and later, for the decode step's chain of small kernels.

At batch 1 a decode step is some 300 kernels of a few microseconds, and each waits for the one before it to
finish before it even starts (launch, then its first DRAM round trip). With PDL a kernel launched with the
attribute (Triton's `launch_pdl=True`) may start as soon as the kernel before it lets it (`release_dependents`,
early in that kernel), read what no earlier kernel writes (weights), then wait (`wait_for_inputs`: until the
earlier kernels have finished and their writes are visible) before it reads their outputs or writes anything.
A kernel without the attribute waits as before, so a release costs nothing where no dependent is launched so.

Both calls are compile-time switches: Triton's interpreter (CPU) knows neither instruction.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True  # False: no kernel launches with PDL nor releases its dependents early (bench preludes compare)
# The decode step's small kernels (norms, RoPE, the KV store, SiLU, decode attention) also launched with PDL, each
# waiting at its start: their launches would overlap the kernel before them. Not yet timed on a GPU, so off:
# bench-quant's *-pdl-all variants measure it (docs/benchmarks.md, twenty-fourth session).
SMALL_KERNELS = False


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_on(device: torch.device) -> bool:
    """PDL applies to kernels on this device: a CUDA GPU of compute capability 9.0 or more, and ENABLED."""
    if not ENABLED or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def chained(device: torch.device) -> bool:
    """The small kernels launch with PDL and wait at their start (SMALL_KERNELS, where pdl_on)."""
    return SMALL_KERNELS and pdl_on(device)


def launch_options(with_pdl: bool) -> dict[str, bool]:
    """Triton launch keywords: launch_pdl where the kernel is launched with PDL."""
    return {"launch_pdl": True} if with_pdl else {}


def small_kernel_args(device: torch.device) -> dict[str, bool]:
    """A small kernel's launch keywords on this device: its `begin` constexprs (RELEASE where pdl_on, WAIT where
    chained) and launch_pdl where chained."""
    wait = chained(device)
    return {"RELEASE": pdl_on(device), "WAIT": wait, **launch_options(wait)}


@triton.jit
def begin(RELEASE: tl.constexpr, WAIT: tl.constexpr):
    """A small kernel's first step: let a kernel after it launched with PDL start (RELEASE); launched with PDL
    itself (WAIT), wait for the kernels before it, before any other memory access."""
    release_dependents(RELEASE)
    wait_for_inputs(WAIT)


@triton.jit
def release_dependents(ON: tl.constexpr):
    """Let a kernel launched after this one with PDL start now (it still waits for this one's writes)."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def wait_for_inputs(ON: tl.constexpr):
    """Wait until the kernels before this one have finished and their writes are visible (PDL launches)."""
    if ON:
        gdc_wait()
