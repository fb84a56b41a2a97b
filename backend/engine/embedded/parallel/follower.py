"""A follower rank's whole life: build the same engine core as rank 0 (its shard, the same KV cache), then run
rank 0's steps until rank 0 shuts down."""

from __future__ import annotations

from ...config import ConfigError, EngineConfig
from ..engine_core import EngineCore
from .step_sync import FollowerRunner


def run_follower(config: EngineConfig) -> int:
    """Serve as a follower rank (RANK > 0) until rank 0's engine stops; returns the number of steps run. Raises
    RankLostError (parallel/group.py) when rank 0 or another follower is gone: the process should then exit."""
    core = EngineCore(config)
    if core.parallel is None or core.parallel.is_leader:
        raise ConfigError(
            "run_follower is for ranks > 0 of a parallel engine (tensor or pipeline); rank 0 runs the engine"
        )
    assert isinstance(core.runner, FollowerRunner)  # parallel/setup.py's runner_class for a follower
    return core.runner.follow()
