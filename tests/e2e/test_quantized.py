"""Quantized models through the real tritonserver, as a user serves them: a W4A16 checkpoint written by
compressed-tensors (the library llm-compressor writes with) as the repository's model folder, loaded as it is, and
a plain checkpoint quantized on load by `quant_config` in `tensorrt_llm/1/model.yaml`, with an FP8 KV cache. Each
gives the embedded engine's own greedy tokens for the same settings, through `tensorrt_llm` and the ensemble;
the quantization is really in force (the plain model's tokens differ)."""

from __future__ import annotations

import e2e_clients as clients
import pytest
import yaml

from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports, TritonServer

from ..engine.quant_checkpoints import write_compressed_tensors
from .conftest import MAX_SEQ_LEN

pytestmark = pytest.mark.server

PROMPTS = ["The lamp turned and turned", "one two three four", "Explain how bread rises in a warm kitchen."]
MAX_TOKENS = 12
ON_LOAD = {"quant_config": {"quant_algo": "W4A16", "group_size": 32}, "kv_cache_config": {"dtype": "fp8"}}


@pytest.fixture(scope="module", params=["compressed-tensors W4A16", "W4A16 on load + FP8 KV"])
def quantized(request, tiny_model, tmp_path_factory):
    """(the server, the model folder it serves, the engine settings model.yaml adds)."""
    work = tmp_path_factory.mktemp("quantized")
    if request.param.startswith("compressed-tensors"):
        model, extra = write_compressed_tensors(tiny_model, work / "w4a16", "W4A16", group_size=32), {}
    else:
        model, extra = tiny_model, ON_LOAD
    repo = build_repo(model, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    if extra:  # the same settings, as a user writes them into model.yaml
        with (repo / "tensorrt_llm" / "1" / "model.yaml").open("a") as yaml_file:
            yaml_file.write("\n" + yaml.safe_dump(extra))
    triton = TritonServer(repo, Ports.free(), log_file=work / "tritonserver.log").start(timeout=180)
    try:
        yield clients.LiveServer(triton, work / "tritonserver.log", MAX_SEQ_LEN), model, extra
    finally:
        triton.stop()


def engine_tokens(model, extra: dict, prompts: list[list[int]], end_id: int) -> list[list[int]]:
    from tritonllm.engine import create_engine
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.types import SamplingParams

    engine = create_engine(EngineConfig.from_dict({"model": str(model), "device": "cpu", **extra}))
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, end_id=end_id)
        return [engine.generate(ids, params).outputs[0].token_ids for ids in prompts]
    finally:
        engine.shutdown()


def test_a_quantized_model_serves_the_engines_own_greedy_tokens(quantized, tiny_model, tokenizer):
    server, model, extra = quantized
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS]
    want = engine_tokens(model, extra, prompts, tokenizer.end_id)
    got = [clients.greedy_token_ids(server, ids, MAX_TOKENS, tokenizer.end_id) for ids in prompts]
    assert got == want
    assert want != engine_tokens(tiny_model, {}, prompts, tokenizer.end_id), "the quantization changed nothing"
    text = server.generate({"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": ""})
    assert text["text_output"] == PROMPTS[0] + tokenizer.decode(want[0])
