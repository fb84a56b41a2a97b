"""Where this Triton server's gRPC endpoint is, seen from inside one of its Python models.

A model cannot ask Triton for its ports, but the Python backend starts each stub as a child of tritonserver, so
the server's command line (/proc/<parent>/cmdline) says which port and address it serves gRPC on. A BLS that
calls models over gRPC thus finds its own server whatever ports it was started with; the `triton_grpc_url`
parameter overrides this (a proxy, TLS termination, an unusual launcher)."""

from __future__ import annotations

import os
from typing import Optional, Sequence

DEFAULT_GRPC_PORT = 8001


class GrpcEndpointError(RuntimeError):
    pass


def server_grpc_url(parent_pid: Optional[int] = None) -> str:
    """host:port of the parent tritonserver's gRPC endpoint (localhost:8001 when its command line is unreadable)."""
    pid = os.getppid() if parent_pid is None else parent_pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            arguments = [part.decode(errors="replace") for part in file.read().split(b"\0") if part]
    except OSError:
        return f"localhost:{DEFAULT_GRPC_PORT}"
    return grpc_url_from_arguments(arguments)


def grpc_url_from_arguments(arguments: Sequence[str]) -> str:
    """The gRPC endpoint a tritonserver command line serves; GrpcEndpointError when it serves none."""
    if (_option(arguments, "allow-grpc") or "true").lower() in ("false", "0", "no", "off"):
        raise GrpcEndpointError(
            "tritonserver runs with --allow-grpc=false, but a decoupled tensorrt_llm_bls calls "
            "tensorrt_llm over the server's gRPC endpoint: allow gRPC, or set the "
            "triton_grpc_url parameter to a server that serves it"
        )
    port = _option(arguments, "grpc-port") or str(DEFAULT_GRPC_PORT)
    address = _option(arguments, "grpc-address") or "0.0.0.0"
    host = "localhost" if address in ("0.0.0.0", "::", "[::]", "") else address
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"{host}:{port}"


def _option(arguments: Sequence[str], name: str) -> Optional[str]:
    """The last value of --name (as --name=value or --name value), as tritonserver's option parser reads it."""
    value = None
    for index, argument in enumerate(arguments):
        if argument.startswith(f"--{name}="):
            value = argument.split("=", 1)[1]
        elif argument == f"--{name}" and index + 1 < len(arguments):
            value = arguments[index + 1]
    return value
