"""Leader mode for `tritonllm launch --world_size N`: tritonserver is rank 0, N - 1 follower processes beside it.

TensorRT-LLM's backend runs one MPI rank per GPU, rank 0 taking the requests (leader mode). Here rank 0 is the
`tensorrt_llm` model inside tritonserver: its stub process inherits the launcher's rank variables
(TRITONLLM_RANK=0, TRITONLLM_WORLD_SIZE, ...: parallel/environment.py) and its embedded engine joins the
parallel group (tensor ranks, pipeline stages). Each follower is `tritonllm follow` with its own rank: it builds
the same engine configuration from the same config.pbtxt and model.yaml, then runs rank 0's steps until rank 0
stops (a rank that dies ends the others: parallel/group.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Mapping

from tritonllm.deploy.tritonserver import free_port
from tritonllm.engine.config import EngineConfig

MASTER_ADDR = "127.0.0.1"  # one host: the ranks of a launch share it


class FollowerError(RuntimeError):
    """The followers cannot start: the engine's settings do not fit the world size, or a follower exited."""


def engine_config_of(repo: Path, model_name: str) -> EngineConfig:
    """The engine configuration the `model_name` model of `repo` builds at load (its config.pbtxt as Triton hands
    it to initialize(), and its version folder's model.yaml)."""
    from google.protobuf.json_format import MessageToDict

    from tritonllm.deploy.pbtxt_check import parse_model_config
    from tritonllm.triton.engine_args import load_tensorrt_llm_settings

    model_dir = Path(repo) / model_name
    config_path = model_dir / "config.pbtxt"
    if not config_path.is_file():
        raise FollowerError(f"--tensorrt_llm_model_name {model_name}: {config_path} does not exist")
    message = parse_model_config(config_path.read_text())
    instances = sum(group.count or 1 for group in message.instance_group) or 1
    if instances > 1:  # each instance is a process of its own, and each would be rank 0
        raise FollowerError(
            f"{config_path}: instance_group asks for {instances} instances; a parallel engine is served by one "
            "(set count: 1)"
        )
    model_config = MessageToDict(message, preserving_proto_field_name=True)
    return load_tensorrt_llm_settings(model_config, model_dir).engine


def check_world_size(config: EngineConfig, world_size: int, model_name: str) -> None:
    if config.world_size != world_size:
        raise FollowerError(
            f"--world_size {world_size} but the {model_name} model's engine runs on {config.world_size} rank(s) "
            f"({config.parallel_layout()}): set tensor_parallel_size x pipeline_parallel_size to {world_size} "
            "in its model.yaml"
        )


def rank_environment(rank: int, world_size: int, port: int, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`base` with this launcher's rank variables for `rank` (parallel/environment.py reads them first)."""
    env = dict(base)
    env.update(
        TRITONLLM_RANK=str(rank),
        TRITONLLM_WORLD_SIZE=str(world_size),
        TRITONLLM_LOCAL_RANK=str(rank),
        TRITONLLM_MASTER_ADDR=MASTER_ADDR,
        TRITONLLM_MASTER_PORT=str(port),
    )
    return env


def start_followers(follow_args: list[str], world_size: int, port: int, log_dir: Path) -> list[subprocess.Popen]:
    """Ranks 1 .. world_size - 1 as `tritonllm follow FOLLOW_ARGS` processes in their own sessions, each logging to
    log_dir/follower-RANK.log. They wait for rank 0 to join the group."""
    followers = []
    for rank in range(1, world_size):
        command = [sys.executable, "-m", "tritonllm", "follow", *follow_args]
        log = open(log_dir / f"follower-{rank}.log", "w")
        followers.append(
            subprocess.Popen(
                command,
                env=rank_environment(rank, world_size, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()  # the child holds its own copy
    return followers


@contextlib.contextmanager
def local_ranks(settings: dict, world_size: int, log_dir: Path) -> Iterator[list[subprocess.Popen]]:
    """This process as rank 0 of `world_size` ranks on this host (its rank variables set while inside), ranks
    1 .. world_size - 1 as `tritonllm follow --engine-args` processes of the same `settings`. Rank 0's engine must
    be shut down inside: that stops the followers, which are then waited for (killed after 30 s)."""
    port = free_port()
    mine = rank_environment(0, world_size, port, base={})
    os.environ.update(mine)
    followers = start_followers(["--engine-args", json.dumps(settings)], world_size, port, log_dir)
    try:
        yield followers
    finally:
        for name in mine:
            os.environ.pop(name, None)
        for process in followers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        stop(followers)


def exited(followers: list[subprocess.Popen]) -> list[str]:
    """'rank R (exit code C)' for each follower that is no longer running."""
    return [f"rank {i} (exit code {p.returncode})" for i, p in enumerate(followers, 1) if p.poll() is not None]


def stop(followers: list[subprocess.Popen]) -> None:
    for process in followers:
        if process.poll() is None:
            process.kill()
            process.wait()
