"""`tritonllm launch`: the TensorRT-LLM backend's `scripts/launch_triton_server.py`, for this project's repositories.

It takes the script's flags and starts tritonserver as the script does (the same tritonserver flags; in the
background, so the command returns while the server keeps serving, and `kill PID` stops it), with three
differences: it finds the tritonserver bundled in the nvidia-pytriton wheel, its backend folder and libpython
by itself when the given binary (by default the NGC container's /opt/tritonserver/bin/tritonserver) is absent;
it checks the repository and the ports before starting; and it waits until the server is ready, so a model that
fails to load is an error of the command. With `--world_size N` > 1 (the embedded engine's tensor and pipeline
parallelism, tensor_parallel_size x pipeline_parallel_size = N in the tensorrt_llm model's model.yaml)
tritonserver is rank 0 and N - 1 follower processes run beside it (deploy/followers.py), one session each; they
stop when tritonserver does.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from tritonllm.deploy import followers
from tritonllm.deploy.launcher_ranks import RankError, leader_environment, outside_rank
from tritonllm.deploy.pbtxt_check import model_config_message, parse_model_config
from tritonllm.deploy.repo import validate_repo
from tritonllm.deploy.server_log import describe_start_failure, start_failure_causes
from tritonllm.deploy.tritonserver import ServerError, prepare_python_stub, server_environment, triton_home
from tritonllm.deploy.tritonserver import free_port as free_port_number
from tritonllm.engine.embedded.parallel.environment import RankEnvironment

NGC_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # the script's default
ANCHOR_LOG_FILE = "triton_log.txt"
# The script gives rank i this prefix, so that several servers on one host keep their shared memory apart.
SHM_PREFIX = "prefix0_"


class LaunchError(ServerError):
    """The launch cannot go ahead (a refused option, a bad repository, a busy port) or the server did not come up."""


@dataclass(frozen=True)
class LaunchOptions:
    """launch_triton_server.py's options, by its names; `wait`/`ready_timeout_s` are this launcher's own."""

    model_repo: Path
    world_size: int = 1
    tritonserver: str = NGC_TRITONSERVER
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    log: bool = False
    log_file: str = ANCHOR_LOG_FILE
    force: bool = False
    no_mpi: bool = False
    oversubscribe: bool = False
    multi_model: bool = False
    disable_spawn_processes: bool = False
    tensorrt_llm_model_name: str = "tensorrt_llm"
    multimodal_gpu0_cuda_mem_pool_bytes: int = 0
    wait: bool = True
    ready_timeout_s: float = 600.0


@dataclass(frozen=True)
class Binary:
    """The tritonserver to run and the backend folder to give it (None: its own default)."""

    path: Path
    backend_dir: Optional[Path]
    bundled: bool


Say = Callable[[str], None]


# ---------------------------------------------------------------------------------------------- checks


def check_options(options: LaunchOptions) -> None:
    if options.world_size < 1:
        raise LaunchError(f"--world_size must be >= 1, got {options.world_size}")
    if options.world_size > 1 and "," in options.tensorrt_llm_model_name:
        raise LaunchError(
            f"--world_size {options.world_size} with several tensorrt_llm models "
            f"({options.tensorrt_llm_model_name}): one parallel engine per launch is supported"
        )
    ports = {"--http_port": options.http_port, "--grpc_port": options.grpc_port, "--metrics_port": options.metrics_port}
    for flag, port in ports.items():
        if not 0 < port < 65536:
            raise LaunchError(f"{flag} must be a port number in 1..65535, got {port}")
    if len(set(ports.values())) < len(ports):
        raise LaunchError(f"the HTTP, gRPC and metrics ports must differ, got {ports}")
    if options.multimodal_gpu0_cuda_mem_pool_bytes < 0:
        raise LaunchError("--multimodal_gpu0_cuda_mem_pool_bytes must be >= 0")
    if not Path(options.model_repo).is_dir():
        raise LaunchError(f"--model_repo {options.model_repo} is not a folder")


def notes(options: LaunchOptions) -> list[str]:
    """A line for each given flag that changes nothing here, so that no one wonders."""
    lines = []
    if options.oversubscribe:
        lines.append("--oversubscribe has no effect: world size 1 starts tritonserver without mpirun")
    if options.multi_model or options.disable_spawn_processes:
        lines.append(
            "--multi-model / --disable-spawn-processes have no effect: they set up the C++ backend's "
            "orchestrator, and each of these Python-backend models already runs in its own process"
        )
    return lines


def running_tritonservers(proc: Path = Path("/proc")) -> list[int]:
    """PIDs of the tritonserver processes on this host (zombies left out)."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "tritonserver":
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def check_no_other_server(force: bool, say: Say, proc: Path = Path("/proc")) -> None:
    pids = " ".join(str(pid) for pid in running_tritonservers(proc))
    if not pids:
        return
    message = f"tritonserver process(es) already found with PID(s): {pids}. Use `kill {pids}` to stop them"
    if not force:
        raise LaunchError(message + ", or pass --force to launch regardless")
    say(message + " (--force: launching regardless)")


def busy_ports(ports: list[int]) -> list[int]:
    """The ports some process listens on already (tritonserver binds all interfaces)."""
    busy = []
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("", port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                busy.append(port)
    return busy


def repo_errors(repo: Path, binary: Binary) -> list[str]:
    """What would keep the repository from loading: validate_repo's findings, then backends the server lacks."""
    errors = validate_repo(repo)
    if errors or binary.backend_dir is None or model_config_message() is None:
        return errors
    available = sorted(path.name for path in binary.backend_dir.iterdir() if path.is_dir())
    for config_path in sorted(repo.glob("*/config.pbtxt")):
        config = parse_model_config(config_path.read_text())
        backend = config.backend
        if not backend or config.platform == "ensemble" or backend in available:
            continue
        hint = (
            ": TensorRT-LLM's C++ backend is not here; these models run on the Python backend "
            "(fill triton_backend:python)"
            if backend == "tensorrtllm"
            else ""
        )
        errors.append(
            f"{config_path}: backend '{backend}' is not in {binary.backend_dir} (it has {', '.join(available)})" + hint
        )
    return errors


def needs_auto_complete(repo: Path) -> bool:
    """True when a model leaves max_batch_size and decoupled to its 1/model.yaml (the LLM-API model): its
    auto_complete_config sets them, which the script's --disable-auto-complete-config would skip, and the model
    would then silently run non-decoupled."""
    for yaml_path in repo.glob("*/1/model.yaml"):
        config_path = yaml_path.parent.parent / "config.pbtxt"
        text = config_path.read_text() if config_path.is_file() else ""
        if model_config_message() is None:
            if "model_transaction_policy" not in text:
                return True
            continue
        config = parse_model_config(text)
        if config.max_batch_size == 0 and not config.HasField("model_transaction_policy"):
            return True
    return False


# ---------------------------------------------------------------------------------------------- the server


def find_tritonserver(requested: str, say: Say) -> Binary:
    """The requested binary if it exists, else the one bundled in the nvidia-pytriton wheel (saying so)."""
    path = Path(requested).expanduser()
    if path.is_file():
        try:
            home = triton_home()
            if path.resolve() == (home / "bin" / "tritonserver").resolve():
                return Binary(path, home / "backends", bundled=True)
        except ServerError:
            pass  # no wheel: the binary stands on its own
        backends = path.resolve().parent.parent / "backends"
        return Binary(path, backends if backends.is_dir() else None, bundled=False)
    home = triton_home()
    bundled = home / "bin" / "tritonserver"
    say(f"{requested} does not exist; using the tritonserver bundled in nvidia-pytriton: {bundled}")
    return Binary(bundled, home / "backends", bundled=True)


def server_command(options: LaunchOptions, binary: Binary, auto_complete: bool) -> list[str]:
    """tritonserver's command line, as the script gives rank 0 of world size 1 (its port flags come twice
    there; once is enough), plus the backend folder when it is not the server's default."""
    command = [str(binary.path), f"--model-repository={Path(options.model_repo).resolve()}"]
    command += [
        f"--grpc-port={options.grpc_port}",
        f"--http-port={options.http_port}",
        f"--metrics-port={options.metrics_port}",
    ]
    if options.log:
        command += ["--log-verbose=3", f"--log-file={options.log_file}"]
    if options.multimodal_gpu0_cuda_mem_pool_bytes:
        command.append(f"--cuda-memory-pool-byte-size=0:{options.multimodal_gpu0_cuda_mem_pool_bytes}")
    if not auto_complete:
        command.append("--disable-auto-complete-config")
    command.append(f"--backend-config=python,shm-region-prefix-name={SHM_PREFIX}")
    if binary.backend_dir is not None:
        command.append(f"--backend-directory={binary.backend_dir}")
    return command


def is_ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{http_port}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_ready(
    process: subprocess.Popen, options: LaunchOptions, ranks: Optional[list[subprocess.Popen]] = None
) -> None:
    """Until the server answers ready; its exit, a follower's (`ranks`) or the timeout is an error (the server is
    then stopped)."""
    deadline = time.monotonic() + options.ready_timeout_s
    where = f"; see {options.log_file}" if options.log else " (its log is above)"
    while time.monotonic() < deadline:
        code = process.poll()
        if code is not None:
            raise LaunchError(_failed_start(code, options) + where)
        gone = followers.exited(ranks or [])
        if gone:
            raise LaunchError(f"follower {', '.join(gone)} exited while tritonserver was loading; see its log")
        if is_ready(options.http_port):
            return
        time.sleep(0.5)
    process.terminate()
    raise LaunchError(f"tritonserver was not ready after {options.ready_timeout_s:.0f}s and was stopped{where}")


def _failed_start(code: int, options: LaunchOptions) -> str:
    """The exit code and, when the log went to --log-file, the cause of each failed model read from it."""
    log = Path(options.log_file)
    if not options.log or not log.is_file():
        return f"tritonserver exited with code {code} while loading the models"
    with log.open(errors="replace") as lines:
        return describe_start_failure(code, start_failure_causes(lines))


def launch(options: LaunchOptions, say: Say = print) -> subprocess.Popen:
    """Check, start tritonserver in its own session (it outlives this process; SIGTERM to its PID stops it and
    its model processes) and, with `options.wait`, wait until it is ready. Returns the process."""
    check_options(options)
    for line in notes(options):
        say(line)
    repo = Path(options.model_repo).resolve()
    binary = find_tritonserver(options.tritonserver, say)
    errors = repo_errors(repo, binary)
    if errors:
        raise LaunchError(f"the model repository {repo} would not load:\n  " + "\n  ".join(errors))
    check_no_other_server(options.force, say)
    busy = busy_ports([options.http_port, options.grpc_port, options.metrics_port])
    if busy:
        raise LaunchError(f"port(s) {busy} already in use: choose others with --http_port/--grpc_port/--metrics_port")
    auto_complete = needs_auto_complete(repo)
    if auto_complete:
        say(
            "keeping Triton's config auto-complete on: the LLM-API model reads max_batch_size/decoupled from model.yaml"
        )
    if binary.bundled:
        prepare_python_stub(triton_home())
    command = server_command(options, binary, auto_complete)
    env, ranks = server_environment(), list[subprocess.Popen]()
    if options.world_size > 1:
        _check_engine_world(options, repo)
        outside = _outside_rank(options)
        if outside is None:
            env, ranks = _start_followers(options, repo, env, say)
        else:
            env = leader_environment(outside, env)
            say(f"leader mode under {outside.launcher}: tritonserver is rank 0 of {outside.world_size}")
    say("starting " + " ".join(command))
    process = subprocess.Popen(command, env=env, start_new_session=True)
    if options.wait:
        try:
            wait_ready(process, options, ranks)
        except (KeyboardInterrupt, LaunchError):
            process.terminate()
            followers.stop(ranks)
            raise
    return process


def _check_engine_world(options: LaunchOptions, repo: Path) -> None:
    name = options.tensorrt_llm_model_name
    try:
        followers.check_world_size(followers.engine_config_of(repo, name), options.world_size, name)
    except (followers.FollowerError, ValueError) as err:
        raise LaunchError(str(err)) from err


def _outside_rank(options: LaunchOptions) -> Optional[RankEnvironment]:
    """The rank an outside launcher (mpirun, srun, torchrun) gave this process, which must be rank 0 here."""
    try:
        outside = outside_rank(options.world_size, os.environ)
    except RankError as err:
        raise LaunchError(str(err)) from err
    if outside is not None and outside.rank != 0:
        raise LaunchError(f"rank {outside.rank} of {outside.launcher} runs the engine only (tritonllm launch does)")
    return outside


def _start_followers(
    options: LaunchOptions, repo: Path, env: dict, say: Say
) -> tuple[dict[str, str], list[subprocess.Popen]]:
    """Leader mode: the followers started, and tritonserver's environment as rank 0."""
    name = options.tensorrt_llm_model_name
    port = free_port_number()
    log_dir = Path(options.log_file).resolve().parent if options.log else repo.parent
    follow_args = [f"--model_repo={repo}", f"--model={name}"]
    ranks = followers.start_followers(follow_args, options.world_size, port, log_dir)
    say(
        f"leader mode: tritonserver is rank 0 of {options.world_size}; followers (PIDs "
        f"{', '.join(str(p.pid) for p in ranks)}) log to {log_dir}/follower-*.log"
    )
    return followers.rank_environment(0, options.world_size, port, env), ranks
