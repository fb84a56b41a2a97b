"""`tritonllm serve`: build (or take) a model repository, start tritonserver on it under the supervisor, and
optionally the OpenAI-compatible front beside it; Ctrl-C or SIGTERM stops everything."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from tritonllm.deploy.frontend import start_next_to_server
from tritonllm.deploy.preflight import check_repository
from tritonllm.deploy.supervisor import Supervisor
from tritonllm.deploy.tritonserver import STOP_GRACE_S, Ports, ServerError, TritonServer


def add_output_options(serve) -> None:
    """What `serve` shows of tritonserver's output, and where all of it goes."""
    serve.add_argument(
        "--log-file", metavar="FILE", help="also append tritonserver's whole output to FILE (nothing filtered)"
    )
    serve.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,  # leaves the value of `tritonllm -v serve` as it is
        help="show all of tritonserver's output (its GPU-less start-up warnings too) and the traceback of an error",
    )


def default_work_dir() -> Path:
    return Path(os.environ.get("TRITONLLM_CACHE", Path.home() / ".cache" / "tritonllm"))


def curl_example(http_url: str) -> str:
    return (
        f"curl -s -X POST http://{http_url}/v2/models/ensemble/generate -d "
        '\'{"text_input": "The capital of France is", "max_tokens": 16, '
        '"bad_words": "", "stop_words": ""}\''
    )


def _repository_for(args, work_dir: Path) -> Path:
    from tritonllm.deploy.repo import build_repo

    if args.repo:
        return Path(args.repo)
    if args.demo:
        from tritonllm.checkpoints.smollm2 import fetch_smollm2

        model_dir = fetch_smollm2(work_dir / "models" / "smollm2")
    else:
        model_dir = Path(args.model).resolve()
    repo = work_dir / "repos" / model_dir.name
    print(f"[serve] building the model repository {repo} for {model_dir}", flush=True)
    return build_repo(model_dir, repo, streaming=args.streaming, max_batch_size=args.max_batch_size, overwrite=True)


def _stop_on_sigterm() -> None:
    """SIGTERM (service managers, `kill`) stops the server as Ctrl-C does, so tritonserver is never orphaned."""

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main(args) -> int:
    _stop_on_sigterm()
    work_dir = Path(args.work_dir) if args.work_dir else default_work_dir()
    repo = _repository_for(args, work_dir)
    check_repository(repo)
    server = TritonServer(
        repo,
        Ports(args.http_port, args.grpc_port, args.metrics_port),
        log_file=Path(args.log_file) if args.log_file else None,
        log_verbose=args.log_verbose,
        show="all" if args.verbose else "filtered",  # without the GPU-less start-up noise unless --verbose
    )
    print(f"[serve] starting tritonserver on {repo} (this takes a few seconds: the models import torch)", flush=True)
    if not _start(server):
        return 0
    print(f"[serve] ready. HTTP {server.http_url}  gRPC {server.grpc_url}  metrics localhost:{args.metrics_port}")
    print(f"[serve] try:\n  {curl_example(server.http_url)}\n[serve] Ctrl-C stops the server.", flush=True)
    frontend = None
    try:
        frontend = start_next_to_server(args, server, repo)  # None unless --openai-port
        Supervisor(server).run()  # restarts tritonserver after a model process dies; returns on Ctrl-C / SIGTERM
    except KeyboardInterrupt:
        _stopping(server)
    except ServerError as exc:
        print(f"[serve] {exc}", flush=True)
        return 1
    finally:
        _ignore_interrupts()  # a second Ctrl-C or SIGTERM must not cut the stop short (a traceback, a stray server)
        if frontend is not None:
            frontend.stop()
        code = server.stop()
    return 0 if code in (0, None, -signal.SIGTERM) else code


def _start(server: TritonServer) -> bool:
    """Starts the server; False after Ctrl-C or SIGTERM while it starts (it is stopped then). A failed start is
    raised, once what is left of the server is stopped."""
    try:
        server.start()
        return True
    except KeyboardInterrupt:
        _stopping(server)
        _ignore_interrupts()
        server.stop()
        return False
    except ServerError:
        _ignore_interrupts()
        server.stop()  # the stubs of the models that did load
        raise


def _stopping(server: TritonServer) -> None:
    limit = server.exit_timeout_secs + STOP_GRACE_S
    print(f"\n[serve] stopping tritonserver (at most {limit} s)", flush=True)


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
