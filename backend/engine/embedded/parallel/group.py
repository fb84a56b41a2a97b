"""Joins the process group of the parallel ranks and wraps what they send each other: the collectives of a
stage's tensor-parallel ranks (their own subgroup when there are several stages), the step plans rank 0
broadcasts to every rank, and the hidden states and logits the pipeline's stages pass on.

gloo on CPU, NCCL on CUDA, where LOCAL_RANK (or the launcher's local rank) picks the GPU. One group per process,
made once: a second engine in the same process reuses it.

A collective that fails (a rank that died closes its connections: the next collective with it raises) raises
RankLostError and leaves the group broken: nothing is sent on it again, so no rank waits on a peer that is gone.
A rank that hangs without dying is not detected (the collectives' timeout is the idle one below)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from .environment import RankEnvironment
from .layout import ParallelLayout

log = logging.getLogger("tritonllm.engine")
# Followers wait for rank 0's next step without a deadline of their own that matters: an idle server may sit for
# hours between requests, so the collectives' timeout is long.
_IDLE_TIMEOUT = timedelta(days=7)
_T = TypeVar("_T")
_broken: list[str] = []  # why the group broke (one entry), process-wide like the group itself


class RankLostError(RuntimeError):
    """A collective with the other ranks failed: a rank is gone (or unreachable) and the group cannot be used."""


def group_broken() -> str | None:
    """Why this process's group broke, or None while it works."""
    return _broken[0] if _broken else None


def mark_broken(reason: str) -> None:
    """Give up on the group from outside a collective (a rank that hangs: step_watch.py): later collectives raise
    RankLostError with `reason` and leave_group skips its barrier."""
    if not _broken:
        _broken.append(reason)


class ParallelGroup:
    def __init__(
        self, env: RankEnvironment, device: torch.device, layout: ParallelLayout, tp_group=None, host_group=None
    ):
        """`tp_group`: this stage's tensor-parallel subgroup; None: the whole world (a single stage). `host_group`:
        a gloo group of all ranks for the plans (pickled bytes between host memories, where NCCL would copy them
        to and from the GPUs and make the host wait); None: the world's (gloo already)."""
        self.env = env
        self.layout = layout
        self.rank = env.rank
        self.world_size = env.world_size
        self.tp_rank = layout.tp_rank
        self.tp_size = layout.tensor
        self.device = device
        self.tp_group = tp_group
        self.host_group = host_group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor ranks, in place (row-parallel outputs, the vocabulary-split embedding)."""
        self._collective("all_reduce", lambda: dist.all_reduce(tensor, group=self.tp_group))
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every tensor rank's slice side by side along the last dimension (vocabulary-split logits)."""
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        self._collective("all_gather", lambda: dist.all_gather(parts, tensor.contiguous(), group=self.tp_group))
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, value=None):
        """Rank 0's `value`, on every rank (the step plans)."""
        box = [value]
        self._collective("broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.host_group))
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        self._collective("all_reduce (min)", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN))
        return int(tensor.item())

    def send(self, tensor: torch.Tensor, rank: int):
        """Start sending `tensor` to `rank`; the returned handle's wait() ends it (keep `tensor` alive till then)."""
        return self._collective(f"send to rank {rank}", lambda: dist.isend(tensor.contiguous(), rank))

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self._collective(f"receive from rank {rank}", lambda: dist.recv(tensor, rank))
        return tensor

    def wait(self, handle) -> None:
        self._collective("send", handle.wait)

    def _collective(self, name: str, run: Callable[[], _T]) -> _T:
        if _broken:
            raise RankLostError(_broken[0])
        try:
            return run()
        except (RuntimeError, OSError) as err:  # gloo: "Connection closed by peer"; NCCL: its error text
            _broken.append(
                f"parallel rank {self.rank} of {self.world_size}: {name} failed, another rank is gone or "
                f"unreachable ({type(err).__name__}: {str(err).strip()[:300]})"
            )
            log.error("%s", _broken[0])
            raise RankLostError(_broken[0]) from err


def join_group(env: RankEnvironment, device: torch.device, layout: ParallelLayout) -> ParallelGroup:
    """The process group of `env` (made on first use): gloo for CPU, NCCL for CUDA on the local rank's GPU; with
    several stages, each stage's tensor-parallel subgroup too (every rank makes every subgroup, in one order)."""
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=_IDLE_TIMEOUT,
        )
        log.info(
            "parallel: rank %d of %d joined (%s, %s): stage %d of %d, tensor rank %d of %d",
            env.rank,
            env.world_size,
            backend,
            env.launcher,
            layout.stage,
            layout.pipeline,
            layout.tp_rank,
            layout.tensor,
        )
    return ParallelGroup(env, device, layout, _stage_subgroup(layout), _host_group(device))


_subgroups: dict[object, object] = {}  # (tensor, pipeline) -> this process's stage subgroup; "host": gloo's


def _host_group(device: torch.device):
    """A gloo group of every rank beside NCCL's (made once, by every rank); None on CPU (the world is gloo)."""
    if device.type != "cuda":
        return None
    if "host" not in _subgroups:
        _subgroups["host"] = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return _subgroups["host"]


def _stage_subgroup(layout: ParallelLayout):
    if layout.pipeline == 1 or layout.tensor == 1:
        return None  # one stage: the world; one rank per stage: no tensor-parallel collectives
    key = (layout.tensor, layout.pipeline)
    if key not in _subgroups:
        groups = [dist.new_group(layout.stage_ranks(stage)) for stage in range(layout.pipeline)]
        _subgroups[key] = groups[layout.stage]
    return _subgroups[key]


def leave_group(wait_for_others: bool = True) -> None:
    """Tear the process group down before the process exits (gloo's threads abort an exit that finds them
    still running). Every rank calls it, after its last engine has stopped; `wait_for_others` meets the other
    ranks in a barrier first, which a follower of a rank 0 that does not call this (tritonserver's) must skip."""
    if dist.is_initialized():
        if wait_for_others and not _broken:  # a broken group's barrier would wait on the rank that is gone
            dist.barrier()
        dist.destroy_process_group()
        _subgroups.clear()
