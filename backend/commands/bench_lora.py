"""`tritonllm bench lora`: the same requests twice through one embedded engine, first on the base model alone, then
with N random adapters (every target module, rank R) assigned to the requests in turn, so that every step mixes
them; throughput of each run and the ratio. Greedy, end token ignored: every request yields exactly its tokens.

The base model runs before and after the adapters; its time is the mean of the two.
The adapters go in as TensorRT-LLM tensors (lora_weights / lora_config) in a warm-up request each, then the timed
requests name them by id only, as clients of the PEFT cache do."""

from __future__ import annotations

import time

import torch

from tritonllm.commands.bench_engine import make_requests
from tritonllm.commands.bench_report import progress, report
from tritonllm.commands.generate import build_engine_config
from tritonllm.engine.types import LoRARequest, SamplingParams
from tritonllm.lora.adapter import LoraAdapter
from tritonllm.lora.modules import MODULES, ModuleShapes
from tritonllm.lora.trtllm_format import adapter_to_tensors


def random_adapter(shapes: ModuleShapes, rank: int, seed: int) -> LoraAdapter:
    """Every target module of every layer; B scaled so the deltas are a few percent of the base output."""
    generator = torch.Generator().manual_seed(seed)
    adapter = LoraAdapter(source=f"random adapter {seed}")
    for layer in range(shapes.num_layers):
        for module in MODULES:
            in_features, out_features = shapes.shapes[module.hf_name]
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * 0.02 / rank**0.5
            adapter.add(layer, module.hf_name, a, b)
    return adapter


def timed_run(engine, requests, loras) -> float:
    start = time.perf_counter()
    handles = [
        engine.generate_async(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), lora_request=lora)
        for r, lora in zip(requests, loras)
    ]
    for handle, request in zip(handles, requests):
        produced = len(handle.result().outputs[0].token_ids)
        if produced != request.output_len:
            raise RuntimeError(f"engine produced {produced} tokens, expected {request.output_len}")
    return time.perf_counter() - start


def register_adapters(engine, shapes: ModuleShapes, count: int, rank: int) -> list[LoRARequest]:
    """Send each adapter's tensors once (a one-token request); returns id-only requests for the timed run."""
    for task_id in range(1, count + 1):
        weights, config = adapter_to_tensors(random_adapter(shapes, rank, task_id))
        engine.generate_async(
            [1, 2, 3],
            SamplingParams(max_tokens=1, ignore_eos=True),
            lora_request=LoRARequest(lora_int_id=task_id, lora_weights=weights, lora_config=config),
        ).result()
    return [LoRARequest(lora_int_id=task_id) for task_id in range(1, count + 1)]


def main(args) -> int:
    from transformers import AutoTokenizer

    from tritonllm.engine.embedded.engine import EmbeddedEngine

    lora_config = {"max_loras": args.adapters, "max_cpu_loras": args.adapters, "max_lora_rank": args.rank}
    config = build_engine_config(
        args.model,
        args.config,
        dtype=args.dtype,
        device=args.device,
        max_batch_size=args.max_batch_size,
        enable_lora=True,
        lora_config=lora_config,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = make_requests(
        tokenizer, args.requests, (args.prompt, args.prompt), (args.output, args.output), args.seed
    )
    total = sum(r.output_len for r in requests)
    progress(f"{len(requests)} requests x {args.prompt} prompt / {args.output} output tokens; starting the engine")
    engine = EmbeddedEngine(config)
    try:
        shapes = ModuleShapes.of_config(engine.core.model_config)
        ids = register_adapters(engine, shapes, args.adapters, args.rank)
        mixed = [ids[i % len(ids)] for i in range(len(requests))]
        timed_run(engine, requests[:2], [None, ids[0]])  # warm-up
        progress("timing the base model")
        base_s = timed_run(engine, requests, [None] * len(requests))
        progress(f"base: {base_s:.1f}s; timing {args.adapters} adapters mixed")
        lora_s = timed_run(engine, requests, mixed)
        progress(f"adapters: {lora_s:.1f}s; timing the base model again (the machine's drift shows here)")
        base_again_s = timed_run(engine, requests, [None] * len(requests))
        base_s = (base_s + base_again_s) / 2
        dtype, device = engine.core.dtype, engine.core.device
    finally:
        engine.shutdown()
    result = {
        "requests": len(requests),
        "output_tokens": total,
        "adapters": args.adapters,
        "rank": args.rank,
        "targets": [m.trtllm_name for m in MODULES],
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "base_s": round(base_s, 3),
        "base_runs_s": [round(base_s * 2 - base_again_s, 3), round(base_again_s, 3)],
        "lora_s": round(lora_s, 3),
        "base_tok_s": round(total / base_s, 2),
        "lora_tok_s": round(total / lora_s, 2),
    }
    result["ratio"] = round(result["lora_tok_s"] / result["base_tok_s"], 3)
    report(
        result,
        args.json,
        f"base model: {result['base_tok_s']} tok/s   {args.adapters} adapters mixed: "
        f"{result['lora_tok_s']} tok/s   ratio {result['ratio']}x",
    )
    return 0
