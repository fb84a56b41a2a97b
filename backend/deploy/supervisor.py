"""`tritonllm serve`'s watch over its tritonserver.

Triton 2.51 does not notice a model's stub process dying: it keeps answering ready, leaves the requests that were
in flight without a final response, and never restarts the model (docs/faults.md). The supervisor looks every
CHECK_PERIOD_S at the server and at the stub processes it started; when a stub is gone (or the server itself
exited) it kills what is left of the server, which closes every client connection and makes readiness fail, and
starts the server again. Restarts that keep failing (MAX_RESTARTS within RESTART_WINDOW_S) end `serve` with an
error instead, for a process manager or an orchestrator to act on, as vLLM's server exits when its engine dies."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

from tritonllm.deploy.tritonserver import ServerError, TritonServer
from tritonllm.triton.parent_watch import proc_stat_fields

log = logging.getLogger("tritonllm.serve")
CHECK_PERIOD_S = 0.5
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
STUB_NAME = "triton_python_backend_stub"


def stub_processes(server_pid: int) -> dict[int, str]:
    """The live (not zombie) stub processes of a tritonserver: pid -> the model folder each serves."""
    stubs = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = proc_stat_fields(int(proc.name))
            if int(fields[1]) != server_pid or fields[0] == "Z":  # fields: state, ppid, ...
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # the process ended while it was read
        if argv and argv[0].decode(errors="replace").endswith(STUB_NAME) and len(argv) > 1:
            stubs[int(proc.name)] = _model_of(argv[1].decode(errors="replace"))
    return stubs


def _model_of(model_path: str) -> str:
    """`<repo>/<model>/<version>/model.py` -> `<model>`."""
    parts = Path(model_path).parts
    return parts[-3] if len(parts) >= 3 else model_path


class Supervisor:
    """Keeps `server` (started) serving: `run` watches it until `stop` is set, restarting it after a fault."""

    def __init__(
        self, server: TritonServer, start_timeout: float = 300.0, on_restart: Optional[Callable[[str], None]] = None
    ):
        self.server = server
        self.start_timeout = start_timeout
        self.on_restart = on_restart
        self.stop = threading.Event()
        self.restarts: deque[float] = deque()
        self.stubs = stub_processes(server.started_process.pid)

    def run(self) -> None:
        """Watch until `stop` is set; raises ServerError when restarts keep failing."""
        while not self.stop.wait(CHECK_PERIOD_S):
            fault = self.fault()
            if fault is not None:
                self.restart(fault)

    def fault(self) -> Optional[str]:
        """Why the server must be restarted, or None while it is healthy."""
        code = self.server.started_process.poll()
        if code is not None:
            return f"tritonserver exited with code {code}"
        live = stub_processes(self.server.started_process.pid)
        gone = {pid: model for pid, model in self.stubs.items() if pid not in live}
        if gone:
            return "the process of " + ", ".join(f"model '{m}' (pid {p})" for p, m in sorted(gone.items())) + " died"
        self.stubs = live  # stubs started later (e.g. more instances) are watched from now on
        return None

    def restart(self, reason: str) -> None:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        if len(self.restarts) >= MAX_RESTARTS:
            raise ServerError(f"{reason}; {MAX_RESTARTS} restarts in {RESTART_WINDOW_S:.0f}s already: giving up")
        self.restarts.append(now)
        log.error("%s: killing tritonserver (its clients' connections close) and starting it again", reason)
        if self.on_restart is not None:
            self.on_restart(reason)
        self.server.kill()
        started = time.monotonic()
        self.server.start(self.start_timeout)
        self.stubs = stub_processes(self.server.started_process.pid)
        log.warning("tritonserver serves again, %.1fs after the restart began", time.monotonic() - started)
