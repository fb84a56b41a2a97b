"""`tritonllm follow`: one follower rank of `tritonllm launch --world_size N` or of a parallel `bench engine`
(deploy/followers.py starts it with its rank's variables): the engine configuration (the tensorrt_llm model's,
read as that model reads it, or given as JSON), then rank 0's steps until rank 0 stops."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn


def add_follow_command(sub) -> None:
    parser = sub.add_parser(
        "follow",
        help="run a follower rank of a tensor- or pipeline-parallel launch (tritonllm launch --world_size N "
        "starts these)",
        description="Builds the engine of a repository's tensorrt_llm model as that model builds it at load "
        "(config.pbtxt and model.yaml), or the engine --engine-args gives, joins the parallel group that the "
        "rank variables name (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, or the MPI / Slurm ones) "
        "and runs rank 0's steps until rank 0 stops. Exits 0 when rank 0 shut down, 1 when another rank was lost.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model_repo", help="the model repository tritonserver serves")
    source.add_argument(
        "--engine-args",
        help="the engine's settings as a JSON object of model.yaml keys, model included (a parallel bench engine)",
    )
    parser.add_argument(
        "--model", default="tensorrt_llm", help="the engine's model in --model_repo (default tensorrt_llm)"
    )


def main(args) -> NoReturn:
    from tritonllm.engine.config import EngineConfig

    if args.engine_args is not None:
        follow_engine(EngineConfig.from_dict(json.loads(args.engine_args)))
    follow_repository(Path(args.model_repo), args.model)


def follow_repository(model_repo: Path, model: str) -> NoReturn:
    """Follow the engine of `model` in `model_repo` (as the model builds it at load)."""
    from tritonllm.deploy.followers import engine_config_of

    follow_engine(engine_config_of(Path(model_repo), model))


def follow_engine(config) -> NoReturn:
    """Run rank 0's steps of `config`'s engine until rank 0 stops, then end the process: 0, or 1 when another rank
    was lost."""
    from tritonllm.engine.embedded.parallel.follower import run_follower
    from tritonllm.engine.embedded.parallel.group import RankLostError, leave_group

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = 0
    try:
        run_follower(config)
    except RankLostError as err:
        logging.getLogger("tritonllm.engine").error("follower stops: %s", err)
        code = 1
    leave_group(wait_for_others=False)  # rank 0, inside tritonserver, leaves without a barrier
    _end_process(code)


def _end_process(code: int) -> NoReturn:
    """Exit without the interpreter's teardown, its output flushed: once the group is left a follower has nothing
    to release, and a C++ destructor of that teardown aborted a follower in CI once ("terminate called without an
    active exception", exit -6, after rank 0's server stopped), which would report a clean stop as a crash."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
