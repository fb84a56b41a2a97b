"""`tritonllm launch --world_size N` started on every rank by an outside launcher (mpirun, srun, torchrun), as
TensorRT-LLM's leader mode runs under `srun --mpi=pmix`, across hosts too.

Each rank's process finds its rank in the launcher's variables (parallel/environment.py). Rank 0 starts
tritonserver and stays in the foreground for as long as it runs (a launcher ends a job whose tasks exit); its
environment carries the rank as this project's own TRITONLLM_* variables and drops the launcher's, which other
models' libraries would take for a torch job of their own. Every other rank runs the engine only
(`tritonllm follow`). MASTER_ADDR / MASTER_PORT say where rank 0 listens, as for any torch job."""

from __future__ import annotations

import signal
import subprocess
from typing import Mapping, Optional

from tritonllm.engine.embedded.parallel.environment import LAUNCHER_VARIABLES, RankEnvironment, read_rank_environment


class RankError(ValueError):
    """The launcher's ranks do not fit the launch (another world size)."""


def outside_rank(world_size: int, environ: Mapping[str, str]) -> Optional[RankEnvironment]:
    """This process's rank when an outside launcher started it (None without one, or under our own launch)."""
    env = read_rank_environment(environ)
    if env is None or env.launcher == "tritonllm launch":
        return None
    if env.world_size != world_size:
        raise RankError(
            f"--world_size {world_size} but the {env.launcher} environment has {env.world_size} rank(s): start "
            f"as many processes as --world_size"
        )
    return env


def leader_environment(env: RankEnvironment, base: Mapping[str, str]) -> dict[str, str]:
    """tritonserver's environment as rank 0 of `env`'s world."""
    leader = {name: value for name, value in base.items() if name not in LAUNCHER_VARIABLES}
    leader.update(
        TRITONLLM_RANK="0",
        TRITONLLM_WORLD_SIZE=str(env.world_size),
        TRITONLLM_LOCAL_RANK=str(env.local_rank),
        TRITONLLM_MASTER_ADDR=env.master_addr,
        TRITONLLM_MASTER_PORT=str(env.master_port),
    )
    return leader


def serve_in_foreground(process: subprocess.Popen) -> int:
    """Wait for tritonserver, handing it SIGTERM / SIGINT (the launcher's way to end the job); its exit code."""

    def forward(signum, _frame) -> None:
        process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
