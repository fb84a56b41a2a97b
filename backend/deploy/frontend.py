"""Runs the frontend as a child process next to a tritonserver (`tritonllm serve --openai-port`, the benchmark).

A child process, not a thread of the launcher: the frontend's event loop then never competes with the
launcher for the GIL, and stopping it is stopping a process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from tritonllm.deploy.preflight import string_parameter
from tritonllm.deploy.tritonserver import ServerError


class FrontendStartError(ServerError):
    pass


def tokenizer_dir_of_repo(repo: Path) -> Path:
    """The `tokenizer_dir` a model repository's preprocessing model loads: the model folder to serve."""
    config = Path(repo) / "preprocessing" / "config.pbtxt"
    try:
        tokenizer_dir = string_parameter(config, "tokenizer_dir")
    except OSError:
        raise FrontendStartError(
            f"{config} is missing: the OpenAI endpoint needs the repository's preprocessing model to find the tokenizer"
        ) from None
    if not tokenizer_dir or tokenizer_dir.startswith("${"):
        raise FrontendStartError(f"{config} has no tokenizer_dir filled in")
    return Path(tokenizer_dir)


class FrontendProcess:
    def __init__(
        self,
        triton_grpc_url: str,
        model_dir: Path,
        port: int,
        extra: Sequence[str] = (),
        log_file: Optional[Path] = None,
    ):
        self.port = port
        self.command = [
            sys.executable,
            "-m",
            "tritonllm",
            "openai",
            "--triton-url",
            triton_grpc_url,
            "--model-dir",
            str(model_dir),
            "--port",
            str(port),
            *extra,
        ]
        self.log_file = log_file
        self.process: Optional[subprocess.Popen] = None

    @property
    def base_url(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self, timeout: float = 120.0) -> "FrontendProcess":
        output = open(self.log_file, "ab") if self.log_file else None
        self.process = subprocess.Popen(self.command, stdout=output, stderr=subprocess.STDOUT if output else None)
        try:
            self._wait_healthy(timeout)
        except BaseException:  # Ctrl-C or SIGTERM while starting too: never leave the child behind
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        process = self.process
        assert process is not None  # start() set it
        while not self._healthy():
            if process.poll() is not None:
                raise FrontendStartError(
                    f"the OpenAI endpoint exited with code {process.returncode} while "
                    "starting" + (f"; see {self.log_file}" if self.log_file else "")
                )
            if time.monotonic() > deadline:
                raise FrontendStartError(f"the OpenAI endpoint was not healthy after {timeout:.0f}s")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "FrontendProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def max_tokens_arguments(args) -> list[str]:
    """The --max-tokens-* options `serve` got, passed on to the endpoint it starts."""
    extra = []
    for name in ("max_tokens_default", "max_tokens_limit"):
        value = getattr(args, name, None)
        if value is not None:
            extra += ["--" + name.replace("_", "-"), str(value)]
    return extra


def start_next_to_server(args, server, repo: Path) -> Optional[FrontendProcess]:
    """For `tritonllm serve --openai-port N`: the frontend on N, once Triton is ready; None without the option."""
    port = getattr(args, "openai_port", None)
    if port is None:
        return None
    model_dir = tokenizer_dir_of_repo(repo)
    extra = ["--served-model-name", model_dir.name, *max_tokens_arguments(args)]
    frontend = FrontendProcess(server.grpc_url, model_dir, port, extra=extra)
    print(f"[serve] starting the OpenAI-compatible endpoint on port {port}", flush=True)
    frontend.start()
    print(
        f"[serve] OpenAI endpoint: {frontend.base_url}/v1 (model '{model_dir.name}'); try:\n  curl -s "
        f"{frontend.base_url}/v1/chat/completions -H 'Content-Type: application/json' -d "
        f'\'{{"model": "{model_dir.name}", "messages": [{{"role": "user", "content": "Hi"}}], '
        '"max_tokens": 16}\'',
        flush=True,
    )
    return frontend
