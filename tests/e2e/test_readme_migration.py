"""README's "Coming from the TensorRT-LLM backend" runs as written: its bash blocks, with the model folder, the
checkout's paths and free ports put in, fill the templates with the backend's fill_template.py arguments, launch
with launch_triton_server.py's flags, and answer the backend's curl commands; the LLM-API block resolves its
Hugging Face id from a hub cache filled here (offline)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tritonllm.deploy.tritonserver import Ports

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Coming from the TensorRT-LLM backend"
HUB_ID = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def as_run_here(block: str, model_dir: Path, ports: Ports) -> str:
    """The block with this machine's parts: the model folder, the checkout's models/ and tritonllm, free ports
    (and --force: the session's other servers are running)."""
    tritonllm = str(Path(sys.executable).with_name("tritonllm"))
    block = block.replace("/path/to/hf-model", str(model_dir)).replace(".venv/bin/tritonllm", tritonllm)
    block = block.replace(" models/", f" {ROOT}/models/").replace("localhost:8000", f"localhost:{ports.http}")
    flags = f" --http_port {ports.http} --grpc_port {ports.grpc} --metrics_port {ports.metrics} --force"
    return re.sub(r"(--model_repo=\S+)", r"\1" + flags, block)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def run_block(block: str, cwd: Path, env: dict[str, str]) -> str:
    """Run the block with bash -e; then stop every server it launched (by the PID `launch` prints)."""
    output = cwd / "block.out"
    with output.open("w") as sink:  # a launched server inherits it: a pipe would stay open while it runs
        code = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT
        ).returncode
    text = output.read_text(errors="replace")
    pids = [int(pid) for pid in re.findall(r"stop it with: kill (\d+)", text)]
    for pid in pids:
        subprocess.run(["kill", str(pid)], check=False)
    deadline = time.monotonic() + 40
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code == 0, text[-4000:]
    assert pids and all(map(_gone, pids)), text[-4000:]
    return text


def test_the_readme_blocks_have_the_backends_commands():
    blocks = readme_blocks()
    assert len(blocks) == 2
    assert blocks[0].count("tritonllm repo fill -i") == 5 and "tritonllm launch --world_size 1" in blocks[0]
    assert blocks[0].count("curl -X POST") == 2 and f"model: {HUB_ID}" in blocks[1]


def test_the_inflight_batcher_steps_serve_the_ensemble_and_the_bls(tiny_model, tmp_path):
    ports = Ports.free()
    text = run_block(as_run_here(readme_blocks()[0], tiny_model, ports), tmp_path, dict(os.environ))
    answers = re.findall(r'\{"model_name":"(ensemble|tensorrt_llm_bls)".*?"text_output":"', text)
    assert answers == ["ensemble", "tensorrt_llm_bls"], text[-4000:]


def test_the_llmapi_steps_resolve_a_hub_id_and_serve(tiny_model, tmp_path, fill_hub_cache):
    hub = tmp_path / "hf_home" / "hub"
    fill_hub_cache(hub, HUB_ID, tiny_model)
    env = {**os.environ, "HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    work = tmp_path / "work"
    work.mkdir()
    text = run_block(as_run_here(readme_blocks()[1], tiny_model, Ports.free()), work, env)
    assert re.search(r'\{"model_name":"tensorrt_llm".*?"text_output":"', text), text[-4000:]
