"""The rank environment a launcher sets, parsed once into a `RankEnvironment`.

Sources, first match wins: `tritonllm launch --world_size N` (TRITONLLM_RANK / TRITONLLM_WORLD_SIZE /
TRITONLLM_LOCAL_RANK, TRITONLLM_MASTER_ADDR / TRITONLLM_MASTER_PORT: names of its own, so that the other models'
processes of the same tritonserver, which inherit them too, do not take themselves for ranks of a torch job),
torchrun (RANK / WORLD_SIZE / LOCAL_RANK), Open MPI (OMPI_COMM_WORLD_*), PMI (PMI_RANK / PMI_SIZE, as MPICH and
Intel MPI set them) and Slurm (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID). For those, MASTER_ADDR / MASTER_PORT
say where rank 0 listens (torchrun sets them; with the others the user exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ...config import ConfigError

# (launcher, rank variable, world size variable, local rank variable or None, the master's variables' prefix)
_SOURCES = (
    ("tritonllm launch", "TRITONLLM_RANK", "TRITONLLM_WORLD_SIZE", "TRITONLLM_LOCAL_RANK", "TRITONLLM_"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", ""),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", ""),
    ("PMI", "PMI_RANK", "PMI_SIZE", None, ""),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""),
)
# The variables outside launchers set for a rank (not this project's own TRITONLLM_*).
LAUNCHER_VARIABLES = tuple(name for source in _SOURCES[1:] for name in source[1:4] if name is not None) + (
    "MASTER_ADDR",
    "MASTER_PORT",
)
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class RankEnvironment:
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def require_world_size(self, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
        """One rank per shard of each stage: the world is exactly tensor_parallel_size x pipeline_parallel_size."""
        expected = tensor_parallel_size * pipeline_parallel_size
        if self.world_size != expected:
            sizes = f"tensor_parallel_size={tensor_parallel_size}"
            if pipeline_parallel_size > 1:
                sizes += f" x pipeline_parallel_size={pipeline_parallel_size}"
            raise ConfigError(
                f"{sizes} but the {self.launcher} environment has {self.world_size} rank(s); launch exactly "
                f"{expected} processes"
            )


def read_rank_environment(environ: Mapping[str, str]) -> Optional[RankEnvironment]:
    """The environment's ranks, or None when no launcher set any (a single process)."""
    for launcher, rank_var, size_var, local_var, prefix in _SOURCES:
        if rank_var not in environ and size_var not in environ:
            continue
        world_size = _integer(environ, size_var, minimum=1, launcher=launcher)
        rank = _integer(environ, rank_var, minimum=0, launcher=launcher)
        if rank >= world_size:
            raise ConfigError(f"{rank_var}={rank} is not below {size_var}={world_size}")
        local_rank = _integer(environ, local_var, minimum=0, launcher=launcher) if local_var in environ else rank
        return RankEnvironment(
            launcher,
            rank,
            world_size,
            local_rank,
            environ.get(prefix + "MASTER_ADDR") or DEFAULT_MASTER_ADDR,
            _port(environ, prefix + "MASTER_PORT"),
        )
    return None


def _integer(environ: Mapping[str, str], name: Optional[str], minimum: int, launcher: str) -> int:
    if name is None or name not in environ:
        raise ConfigError(f"{launcher} environment: {name} is not set")
    raw = environ[name].strip()
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _port(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name)
    if not raw:
        return DEFAULT_MASTER_PORT
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"{name} must be a TCP port (1-65535), got {port}")
    return port
