"""End-to-end fixtures: the real tritonserver (from the nvidia-pytriton wheel) on repositories built by
`build_repo` for a tiny random model, and small clients for its HTTP, SSE, gRPC-stream and metrics endpoints.

One decoupled server serves the whole session; the non-decoupled one and the LLM-API one (`build_llmapi_repo`)
start only for the tests that ask for them.
Each server logs to a file; a failing test gets the tail of every server log in its report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("pytriton", reason="the e2e tests need the nvidia-pytriton wheel (tritonserver)")
pytest.importorskip("tritonclient.grpc", reason="the e2e tests need tritonclient[grpc]")

from tritonllm.checkpoints.tiny import build_tiny_model  # noqa: E402
from tritonllm.deploy.llmapi_repo import build_llmapi_repo  # noqa: E402
from tritonllm.deploy.repo import build_repo  # noqa: E402
from tritonllm.deploy.tritonserver import Ports, TritonServer  # noqa: E402


def _load_clients():
    """Register clients.py as `e2e_clients`, so that the test modules can import it."""
    spec = importlib.util.spec_from_file_location("e2e_clients", Path(__file__).with_name("clients.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_clients"] = module
    spec.loader.exec_module(module)
    return module


clients = _load_clients()

MAX_BEAM_WIDTH = 4
MAX_SEQ_LEN = 2048  # long enough for a stream that runs for seconds unless it is cancelled
LOG_TAIL_LINES = 80
_server_logs: list[Path] = []
_live_servers: list["clients.LiveServer"] = []


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from tritonllm.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model))


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory) -> Iterator["clients.LiveServer"]:
    """The decoupled (streaming) repository, as `tritonllm repo build` makes it."""
    yield from _serve(tiny_model, tmp_path_factory.mktemp("decoupled"), streaming=True)


@pytest.fixture(scope="module")
def plain_server(tiny_model, tmp_path_factory) -> Iterator["clients.LiveServer"]:
    """The non-decoupled repository; module-scoped so it stops once its tests are done."""
    yield from _serve(tiny_model, tmp_path_factory.mktemp("non_decoupled"), streaming=False)


@pytest.fixture(scope="module")
def llmapi_server(tiny_model, tmp_path_factory) -> Iterator["clients.LiveServer"]:
    """The LLM-API model alone (`tritonllm repo build --llmapi`), decoupled, guided decoding on (model.yaml's
    `guided_decoding_backend: xgrammar`); module-scoped."""
    work = tmp_path_factory.mktemp("llmapi")
    guided = {"guided_decoding_backend": "xgrammar"}
    repo = build_llmapi_repo(tiny_model, work / "repo", max_seq_len=MAX_SEQ_LEN, engine_args=guided)
    yield from _run(repo, work, probe_model="tensorrt_llm")


@pytest.fixture(scope="module")
def lora_server(tiny_model, lora_prefetch_dir, tmp_path_factory) -> Iterator["clients.LiveServer"]:
    """The decoupled repository with LoRA on: `lora_prefetch_dir` (a fixture of the test module) preloaded by name,
    and a small adapter cache (lora_config.max_cpu_loras = max_loras = 2 in model.yaml) so that tests can evict."""
    work = tmp_path_factory.mktemp("lora")
    repo = build_repo(
        tiny_model,
        work / "repo",
        streaming=True,
        max_seq_len=MAX_SEQ_LEN,
        parameters={"lora_prefetch_dir": str(lora_prefetch_dir)},
    )
    with (repo / "tensorrt_llm" / "1" / "model.yaml").open("a") as yaml_file:
        yaml_file.write("\nlora_config:\n  max_cpu_loras: 2\n  max_loras: 2\n")
    yield from _run(repo, work)


@pytest.fixture(scope="module")
def draft_server(tiny_model, tmp_path_factory) -> Iterator["clients.LiveServer"]:
    """The decoupled repository plus `tensorrt_llm_draft` (a tiny model with other weights, same tokenizer) for the
    BLS draft/target loop; module-scoped."""
    work = tmp_path_factory.mktemp("draft")
    draft = build_tiny_model(work / "draft_model", seed=7)
    yield from _run(
        build_repo(tiny_model, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN, draft_model_dir=draft), work
    )


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> Path:
    """The tiny Mistral: sliding-window attention over its last TINY_SLIDING_WINDOW tokens, the same tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mistral"), seed=2, arch="mistral")


@pytest.fixture(scope="module")
def window_server(request, tiny_mistral, tmp_path_factory) -> Iterator["clients.LiveServer"]:
    """The decoupled repository for the tiny Mistral with the tensorrt_llm model's `max_attention_window_size` set
    to the test module's MAX_ATTENTION_WINDOW_SIZE; module-scoped."""
    work = tmp_path_factory.mktemp("window")
    repo = build_repo(
        tiny_mistral,
        work / "repo",
        streaming=True,
        max_seq_len=MAX_SEQ_LEN,
        parameters={"max_attention_window_size": request.module.MAX_ATTENTION_WINDOW_SIZE},
    )
    yield from _run(repo, work)


def _serve(model_dir: Path, work: Path, streaming: bool) -> Iterator["clients.LiveServer"]:
    yield from _run(
        build_repo(
            model_dir,
            work / "repo",
            streaming=streaming,
            max_seq_len=MAX_SEQ_LEN,
            parameters={"max_beam_width": MAX_BEAM_WIDTH},
        ),
        work,
    )


def _run(repo: Path, work: Path, probe_model: str = "ensemble") -> Iterator["clients.LiveServer"]:
    log_file = work / "tritonserver.log"
    _server_logs.append(log_file)
    triton = TritonServer(repo, Ports.free(), log_file=log_file)
    try:
        triton.start(timeout=180)
    except BaseException:
        triton.stop()
        raise  # the log stays listed, so the failed setup's report shows why
    live = clients.LiveServer(triton, log_file, MAX_SEQ_LEN, probe_model=probe_model)
    _live_servers.append(live)
    try:
        yield live
    finally:
        _live_servers.remove(live)
        triton.stop()
        _server_logs.remove(log_file)


@pytest.fixture(autouse=True)
def _fail_fast_on_a_broken_server(request):
    """A test whose server stopped serving in an earlier test fails at once: a hung server would otherwise cost
    every later test its clients' timeouts (one hang ran CI past its time limit without a report)."""
    for live in _live_servers:
        if live.broken and any(request.getfixturevalue(name) is live for name in _server_fixtures(request)):
            pytest.fail(live.broken, pytrace=False)


def _server_fixtures(request) -> list[str]:
    return [name for name in request.fixturenames if name.endswith("server") and not name.startswith("_")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _mark_broken_servers(item.nodeid)
        for log_file in _server_logs:
            if log_file.exists():
                lines = [
                    line
                    for line in log_file.read_text(errors="replace").splitlines()
                    if not line.startswith(("|", "+"))
                ][-LOG_TAIL_LINES:]  # without the start-up tables
                report.sections.append((f"tritonserver log {log_file} (last {len(lines)} lines)", "\n".join(lines)))


def _mark_broken_servers(nodeid: str) -> None:
    """After a failure, ask each live server for two tokens; one that cannot serve them is marked broken."""
    for live in _live_servers:
        if live.broken is None:
            problem = live.still_serves()
            if problem is not None:
                live.broken = f"this test's server stopped serving during {nodeid}: {problem}"
