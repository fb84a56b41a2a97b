"""Starts the real `tritonserver` shipped in the `nvidia-pytriton` wheel on a model repository.

The wheel carries Triton 2.51 with its Python backend but puts no stub in `backends/python`; the stub runs Python
in isolated mode (PYTHONPATH ignored) and finds packages through the first `python3` on PATH, and it must load the
same libpython as the interpreter. `TritonServer` takes care of all three."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tritonllm.deploy.server_log import OutputPump, describe_start_failure, start_failure_causes


class ServerError(RuntimeError):
    pass


def triton_home() -> Path:
    try:
        import pytriton
    except ImportError:
        raise ServerError(
            "tritonserver comes from the nvidia-pytriton wheel: pip install nvidia-pytriton==0.7.0"
        ) from None
    home = Path(pytriton.__file__).parent / "tritonserver"
    if not (home / "bin" / "tritonserver").exists():
        raise ServerError(f"no tritonserver binary in {home}")
    return home


def prepare_python_stub(home: Path) -> None:
    """Put the stub for this Python version where the Python backend looks for it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = home / "backends" / "python" / "triton_python_backend_stub"
    source = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not source.exists():
        raise ServerError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        shutil.copy2(source, target)


def server_environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
_pick = random.SystemRandom()  # not the global generator, which tests seed alike in every process


def free_port(avoid: tuple[int, ...] = ()) -> int:
    """A TCP port nothing listens on now, for a server started next. Chosen below the kernel's ephemeral range
    where it has one: a port the kernel hands out (what binding port 0 gives) may go to an outgoing connection,
    another process's or gloo's between engine ranks, before the server binds it."""
    low = _ephemeral_low()
    for _ in range(100 if low > LOWEST_PORT else 0):
        port = _pick.randrange(LOWEST_PORT, low)
        if port not in avoid and _bindable(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux), or 0 where unknown."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> "Ports":
        http = free_port()
        grpc = free_port(avoid=(http,))
        return cls(http, grpc, free_port(avoid=(http, grpc)))


STOP_GRACE_S = 5  # past tritonserver's own exit timeout, before its process group is killed


class TritonServer:
    """A running tritonserver process; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        repo: str | Path,
        ports: Optional[Ports] = None,
        log_file: Optional[Path] = None,
        log_verbose: int = 0,
        exit_timeout_secs: int = 10,
        explicit_model_control: bool = False,
        show: Optional[str] = None,
    ):
        """`show`: what of the server's output goes to stdout: "all", "filtered" (without the GPU-less noise; our
        models' lines made readable: server_log.console_line) or "none"; default "none" with a log file, else
        "all". The log file always gets everything."""
        self.repo = Path(repo).resolve()
        self.show = show or ("none" if log_file else "all")
        self.output: Optional[OutputPump] = None
        self.explicit_model_control = explicit_model_control  # every model loaded, then loadable and unloadable
        self.ports = ports or Ports()
        self.log_file = log_file
        self.log_verbose = log_verbose
        self.exit_timeout_secs = exit_timeout_secs
        self.process: Optional[subprocess.Popen] = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.ports.grpc}"

    def command(self) -> list[str]:
        home = triton_home()
        return [
            str(home / "bin" / "tritonserver"),
            "--model-repository",
            str(self.repo),
            "--backend-directory",
            str(home / "backends"),
            f"--http-port={self.ports.http}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}",
            f"--exit-timeout-secs={self.exit_timeout_secs}",
            f"--log-verbose={self.log_verbose}",
        ] + (["--model-control-mode=explicit", "--load-model=*"] if self.explicit_model_control else [])

    def start(self, timeout: float = 300.0) -> "TritonServer":
        prepare_python_stub(triton_home())
        log = open(self.log_file, "ab") if self.log_file else None
        # Its own process group: the stubs it starts join it, so that kill() ends them all at once.
        self.process = subprocess.Popen(
            self.command(),
            env=server_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self.output = OutputPump(self.process.stdout, self.show, log).start()
        self.wait_ready(timeout)
        return self

    @property
    def started_process(self) -> subprocess.Popen:
        """The tritonserver process, once start() has run."""
        assert self.process is not None, "tritonserver is not started"
        return self.process

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.started_process.poll() is not None:
                failure = self._start_failure()
                self._kill_group()  # stubs it started and left behind
                raise failure
            if self.is_ready():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"tritonserver was not ready after {timeout:.0f}s")

    def _start_failure(self) -> ServerError:
        """The exit code and, from the server's last lines, which model failed and why."""
        lines = self.output.join(timeout=5.0) if self.output is not None else []
        message = describe_start_failure(self.started_process.returncode, start_failure_causes(lines))
        return ServerError(message + (f"\n  (the whole server log: {self.log_file})" if self.log_file else ""))

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, timeout: Optional[float] = None) -> Optional[int]:
        """SIGTERM, then SIGKILL for the whole process group once `timeout` (default: the exit timeout plus
        STOP_GRACE_S) has passed; any stub left behind is killed too. Returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.exit_timeout_secs + STOP_GRACE_S if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
        self._kill_group()  # stubs that outlived their server
        return self.process.wait()

    def kill(self) -> Optional[int]:
        """SIGKILL tritonserver and every stub it started; returns the exit code."""
        if self.process is None:
            return None
        self._kill_group()
        return self.process.wait()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.started_process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing of the group is left

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
