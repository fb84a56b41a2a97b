"""`tritonllm launch`: takes the TensorRT-LLM backend's `scripts/launch_triton_server.py` flags unchanged
(`python3 launch_triton_server.py --world_size 1 --model_repo=R` becomes `tritonllm launch --world_size 1
--model_repo=R`). The logic is in deploy/launch.py."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from tritonllm.commands.follow import follow_repository
from tritonllm.deploy.launch import ANCHOR_LOG_FILE, NGC_TRITONSERVER, LaunchError, LaunchOptions, launch
from tritonllm.deploy.launcher_ranks import RankError, outside_rank, serve_in_foreground


def add_launch_command(sub) -> None:
    parser = sub.add_parser(
        "launch",
        help="start tritonserver in the background, with launch_triton_server.py's flags",
        description="Starts tritonserver on a model repository as the TensorRT-LLM backend's "
        "scripts/launch_triton_server.py does, with its flags, and returns once the server is ready while it "
        "keeps serving in the background; `kill PID` (the PID is printed) stops it. The given --tritonserver "
        "is used when it exists, else the one bundled in nvidia-pytriton (with its backend folder and "
        "libpython). The repository and the ports are checked first.",
    )
    parser.add_argument(
        "--world_size",
        type=int,
        default=1,
        help="ranks (default 1); N > 1 serves the tensorrt_llm model's engine over N ranks (tensor_parallel_size "
        "x pipeline_parallel_size = N in its model.yaml): tritonserver is rank 0, N - 1 follower processes beside it. "
        "Under mpirun, srun or torchrun (their rank variables set; MASTER_ADDR / MASTER_PORT: rank 0's host), "
        "run this command on every rank: rank 0 serves tritonserver in the foreground, the others the engine only",
    )
    parser.add_argument(
        "--tritonserver",
        default=NGC_TRITONSERVER,
        help=f"path to the tritonserver executable (default {NGC_TRITONSERVER}); when it does not exist, the "
        "one bundled in nvidia-pytriton is used",
    )
    parser.add_argument("--grpc_port", type=int, default=8001, help="tritonserver gRPC port (default 8001)")
    parser.add_argument("--http_port", type=int, default=8000, help="tritonserver HTTP port (default 8000)")
    parser.add_argument("--metrics_port", type=int, default=8002, help="tritonserver metrics port (default 8002)")
    parser.add_argument(
        "--force",
        "-f",
        action="store_true",
        help="launch even if other tritonserver processes run on this host (they are listed)",
    )
    parser.add_argument("--log", action="store_true", help="verbose tritonserver log (level 3) into --log-file")
    parser.add_argument(
        "--log-file", default=ANCHOR_LOG_FILE, help=f"tritonserver log file with --log (default {ANCHOR_LOG_FILE})"
    )
    parser.add_argument(
        "--no-mpi",
        action="store_true",
        help="start tritonserver without MPI; accepted for the script's command lines: world size 1 never uses "
        "MPI here",
    )
    parser.add_argument("--model_repo", required=True, help="the model repository (tritonllm repo build --out)")
    parser.add_argument(
        "--tensorrt_llm_model_name",
        default="tensorrt_llm",
        help="name of the tensorrt_llm model whose engine the followers of --world_size > 1 join (default "
        "tensorrt_llm); no effect at world size 1",
    )
    parser.add_argument(
        "--multi-model",
        action="store_true",
        help="the C++ backend's orchestrator for several TensorRT-LLM models; accepted, no effect: each "
        "Python-backend model runs in its own process already",
    )
    parser.add_argument(
        "--disable-spawn-processes",
        action="store_true",
        help="with --multi-model in the C++ backend: no spawned worker processes; accepted, no effect",
    )
    parser.add_argument(
        "--multimodal_gpu0_cuda_mem_pool_bytes",
        type=int,
        default=0,
        help="CUDA memory pool on GPU 0 for multimodal models (tritonserver --cuda-memory-pool-byte-size=0:N); "
        "0 (default): Triton's default",
    )
    parser.add_argument(
        "--oversubscribe", action="store_true", help="mpirun's --oversubscribe; accepted, no effect without MPI"
    )
    parser.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="return only once the server is ready, with an error if it exits while loading (default); "
        "--no-wait returns right after the start, as the script does",
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for the server to be ready (default 600)"
    )


def options_from(args) -> LaunchOptions:
    return LaunchOptions(
        model_repo=Path(args.model_repo),
        world_size=args.world_size,
        tritonserver=args.tritonserver,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        log=args.log,
        log_file=args.log_file,
        force=args.force,
        no_mpi=args.no_mpi,
        oversubscribe=args.oversubscribe,
        multi_model=args.multi_model,
        disable_spawn_processes=args.disable_spawn_processes,
        tensorrt_llm_model_name=args.tensorrt_llm_model_name,
        multimodal_gpu0_cuda_mem_pool_bytes=args.multimodal_gpu0_cuda_mem_pool_bytes,
        wait=args.wait,
        ready_timeout_s=args.ready_timeout,
    )


def _say(line: str) -> None:
    print(f"[launch] {line}", flush=True)


def main(args) -> int:
    options = options_from(args)
    try:
        outside = outside_rank(options.world_size, os.environ) if options.world_size > 1 else None
    except RankError as err:
        raise LaunchError(str(err)) from err
    if outside is not None and outside.rank > 0:
        _say(f"rank {outside.rank} of {outside.world_size} under {outside.launcher}: this rank runs the engine only")
        follow_repository(options.model_repo, options.tensorrt_llm_model_name)
    if outside is not None:  # a launcher ending the job while the server starts: stop it, as Ctrl-C does
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        process = launch(options, say=_say)
    except KeyboardInterrupt:
        _say("interrupted: tritonserver stopped")
        return 130
    try:
        state = "ready" if options.wait else "started"
        _say(
            f"tritonserver {state} (PID {process.pid}): HTTP localhost:{options.http_port}  gRPC "
            f"localhost:{options.grpc_port}  metrics localhost:{options.metrics_port}; stop it with: kill {process.pid}"
        )
        if outside is not None:  # the launcher's task lives as long as the server
            _say(f"rank 0 of {outside.world_size} under {outside.launcher}: serving until tritonserver exits")
            return serve_in_foreground(process)
    except KeyboardInterrupt:  # between the start and the hand-over to serve_in_foreground
        process.terminate()
        return process.wait()
    return 0


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt
