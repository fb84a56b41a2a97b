"""LoRA through the real tritonserver: `lora_task_id` + `lora_weights` + `lora_config` on `tensorrt_llm` and the
ensemble, an adapter preloaded from `lora_prefetch_dir` picked by `lora_name`, the base model and two adapters in
one batch, and the adapter cache evicting (max_cpu_loras = 2) without disturbing a request in flight.

References come from the embedded engine in this process, one request at a time, with the same fp16 tensors.
The adapters' weights are rounded to fp16 and their scale (alpha / r = 2) is a power of two, so the fp16 `.npy`
pair and the PEFT folder hold exactly the same adapter."""

from __future__ import annotations

import e2e_clients as clients
import numpy as np
import pytest
import torch
from e2e_clients import direct_request, scalar, strings

pytestmark = pytest.mark.server
peft = pytest.importorskip("peft", reason="the LoRA tests build their adapters with peft")

from tritonllm.engine.config import EngineConfig  # noqa: E402
from tritonllm.engine.embedded.engine import EmbeddedEngine  # noqa: E402
from tritonllm.engine.types import LoRARequest, SamplingParams  # noqa: E402
from tritonllm.lora.convert import convert_peft_folder  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea"
MAX_TOKENS = 12
TARGETS = {
    "fr": ["q_proj", "v_proj", "o_proj", "down_proj"],
    "a": ["q_proj", "k_proj", "gate_proj", "up_proj"],
    "b": ["v_proj", "o_proj", "down_proj"],
    "c": ["q_proj", "up_proj"],
    "d": ["k_proj", "down_proj"],
    "e": ["o_proj", "gate_proj"],
}


def make_adapter(model_dir, out, targets, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(param.half().float())
    wrapped.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """name -> (PEFT folder, fp16 lora_weights [1, rows, cols], lora_config [1, rows, 3])."""
    work = tmp_path_factory.mktemp("lora_adapters")
    result = {}
    for seed, (name, targets) in enumerate(TARGETS.items()):
        folder = make_adapter(tiny_model, work / "peft" / name, targets, seed)
        weights, config = convert_peft_folder(folder, work / "npy" / name)
        result[name] = (folder, np.load(weights), np.load(config))
    return result


@pytest.fixture(scope="module")
def lora_prefetch_dir(adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefetch")
    (folder / "fr").symlink_to(adapters["fr"][0], target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def reference(tiny_model, adapters):
    """Greedy tokens of one request run alone in an in-process engine: reference(name or None, prompt, n)."""
    engine = EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(tiny_model),
                "dtype": "float32",
                "device": "cpu",
                "lora_config": {"max_cpu_loras": 8, "max_loras": 2},
            }
        )
    )
    cache = {}

    def run(name, prompt_ids, max_tokens, end_id):
        key = (name, tuple(prompt_ids), max_tokens, end_id)
        if key not in cache:
            lora = None
            if name is not None:
                _, weights, config = adapters[name]
                lora = LoRARequest(
                    lora_int_id=sorted(TARGETS).index(name) + 1, lora_weights=weights, lora_config=config
                )
            output = engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, end_id=end_id), lora)
            cache[key] = output.outputs[0].token_ids
        return cache[key]

    yield run
    engine.shutdown()


def lora_inputs(adapters, name, task_id, with_weights=True) -> dict[str, np.ndarray]:
    inputs = {"lora_task_id": scalar(task_id, np.uint64)}
    if with_weights:
        _, weights, config = adapters[name]
        inputs.update(lora_weights=weights, lora_config=config)
    return inputs


def output_ids(reply) -> list[int]:
    assert reply.error is None, reply.error
    return [int(t) for array in reply.outputs("output_ids") for t in array.reshape(-1) if t >= 0]


def send(stream, inputs):
    stream.send(
        "tensorrt_llm",
        {**inputs, "streaming": scalar(True, np.bool_), "exclude_input_in_output": scalar(True, np.bool_)},
    )


def test_preloaded_adapters_are_listed_in_the_log(lora_server):
    assert "LoRA adapter 'fr' preloaded as lora_task_id 1" in lora_server.log_file.read_text(errors="replace")


def test_base_and_two_adapters_in_one_batch(lora_server, tokenizer, adapters, reference):
    """Base, a and b, three prompts each, all in flight together: every request gets the tokens it gets alone."""
    texts = (PROMPT, "The quick brown fox", "Hello there, how")
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in texts]
    end_id = tokenizer.end_id
    jobs = []
    for prompt_ids in prompts:
        for name, task_id in ((None, None), ("a", 11), ("b", 12)):
            extra = {} if name is None else lora_inputs(adapters, name, task_id)
            jobs.append((name, prompt_ids, direct_request(prompt_ids, MAX_TOKENS, end_id, **extra)))
    streams = [lora_server.grpc_stream() for _ in jobs]
    try:
        for stream, (_, _, inputs) in zip(streams, jobs):
            send(stream, inputs)
        got = [output_ids(stream.collect()) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    expected = [reference(name, prompt_ids, MAX_TOKENS, end_id) for name, prompt_ids, _ in jobs]
    assert got == expected
    assert expected[0] != expected[1] != expected[2]  # the adapters change the output


def ensemble_text(server, **extra) -> str:
    inputs = {"text_input": strings(PROMPT), "max_tokens": scalar(MAX_TOKENS, np.int32), **extra}
    reply = server.stream_infer("ensemble", inputs)
    assert reply.error is None, reply.error
    (text,) = reply.texts()
    return text


def test_converted_pair_through_the_ensemble_equals_the_preloaded_folder_by_name(lora_server, adapters):
    _, weights, config = adapters["fr"]
    with_tensors = ensemble_text(
        lora_server, lora_task_id=np.array([[21]], np.uint64), lora_weights=weights, lora_config=config
    )
    by_name = ensemble_text(lora_server, lora_name=strings("fr"))
    by_id = ensemble_text(lora_server, lora_task_id=np.array([[1]], np.uint64))  # the preloaded id
    base = ensemble_text(lora_server)
    assert with_tensors == by_name == by_id != base
    bls = lora_server.stream_infer(
        "tensorrt_llm_bls",
        {"text_input": strings(PROMPT), "max_tokens": scalar(MAX_TOKENS, np.int32), "lora_name": strings("fr")},
    )
    assert bls.error is None and bls.texts() == [by_name]


def test_eviction_spares_requests_in_flight(lora_server, tokenizer, adapters, reference):
    """max_cpu_loras = 2. c and d fill the cache; a long request on c stays in flight while e arrives (evicting d,
    the least recently used one not in use) and while an id-only request for d gets the error. The long request's
    tokens are those it gets alone."""
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    long_tokens = 800
    for name, task_id in (("c", 31), ("d", 32)):
        reply = lora_server.stream_infer(
            "tensorrt_llm", direct_request(prompt_ids, 2, -1, **lora_inputs(adapters, name, task_id))
        )
        assert reply.error is None, reply.error
    long_stream = lora_server.grpc_stream()
    try:
        send(long_stream, direct_request(prompt_ids, long_tokens, -1, **lora_inputs(adapters, "c", 31, False)))
        reply = clients.StreamReply()
        clients.add_event(reply, *long_stream.next_event(60))  # its first token: it is running, c is pinned
        evicting = lora_server.stream_infer(
            "tensorrt_llm", direct_request(prompt_ids, 2, -1, **lora_inputs(adapters, "e", 33))
        )
        assert evicting.error is None, evicting.error
        evicted = lora_server.stream_infer(
            "tensorrt_llm", direct_request(prompt_ids, 2, -1, **lora_inputs(adapters, "d", 32, False))
        )
        assert evicted.error and "LoRA task 32 not found in cache" in evicted.error
        assert not reply.finished, "the long request ended before the evictions: the test proved nothing"
        long_stream.collect(reply, timeout=300)
    finally:
        long_stream.close()
    assert output_ids(reply) == reference("c", prompt_ids, long_tokens, -1)


def test_errors_name_the_input_or_id(lora_server, tokenizer, adapters):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    _, weights, config = adapters["a"]
    cases = [
        ({"lora_task_id": scalar(77, np.uint64)}, "LoRA task 77 not found in cache"),
        ({"lora_task_id": scalar(78, np.uint64), "lora_weights": weights}, "'lora_config' is missing"),
        (
            {"lora_task_id": scalar(79, np.uint64), "lora_weights": weights[:, :, :50], "lora_config": config},
            "does not match the model",
        ),
        ({"lora_name": strings("nope")}, "unknown LoRA adapter name 'nope'"),
    ]
    for extra, message in cases:
        reply = lora_server.stream_infer("tensorrt_llm", direct_request(prompt_ids, 2, tokenizer.end_id, **extra))
        assert reply.error and message in reply.error, (message, reply.error)
