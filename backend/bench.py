"""`tritonllm bench engine`: the embedded engine against Hugging Face `generate` on the same requests, in one run.

Both sides decode greedily and ignore the end token, so every request produces exactly its requested number of
tokens; throughput counts those requested tokens over wall time (prefill included). Hugging Face runs the requests
as static batches (left-padded, each batch runs until its longest request is done); the engine gets them all at once."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from importlib import resources

from .bench_report import progress, report
from .engine.types import SamplingParams
from .generate import build_engine_config


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


def make_requests(tokenizer, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> list[BenchRequest]:
    """Prompts cut from the text the package ships, lengths drawn uniformly from the ranges."""
    text = resources.files("tritonllm.model_files").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")
    corpus = tokenizer.encode(text, add_special_tokens=False)
    while len(corpus) < prompt_range[1] * 2:
        corpus = corpus + corpus
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - length)
        requests.append(BenchRequest(corpus[start:start + length], rng.randint(*output_range)))
    return requests


def run_engine(engine, requests: list[BenchRequest]) -> float:
    start = time.perf_counter()
    handles = [engine.generate_async(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
               for r in requests]
    for handle, request in zip(handles, requests):
        produced = len(handle.result().outputs[0].token_ids)
        if produced != request.output_len:
            raise RuntimeError(f"engine produced {produced} tokens, expected {request.output_len}")
    return time.perf_counter() - start


def run_hf(model, tokenizer, requests: list[BenchRequest], batch_size: int) -> float:
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        new_tokens = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start



def check_arguments(args) -> None:
    """A ConfigError naming the flags of a length range that is empty."""
    from .engine.config import ConfigError

    for name in ("prompt", "output"):  # each is >= 1 already (cli_types.count)
        low, high = getattr(args, f"min_{name}"), getattr(args, f"max_{name}")
        if low > high:
            raise ConfigError(f"--min-{name} {low} / --max-{name} {high}: need min <= max")


def main(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .engine import create_engine

    check_arguments(args)
    config = build_engine_config(args.model, args.config, dtype=args.dtype, device=args.device,
                                 max_batch_size=args.max_batch_size)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = make_requests(tokenizer, args.requests, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), args.seed)
    total_tokens = sum(r.output_len for r in requests)
    progress(f"{len(requests)} requests, {total_tokens} output tokens; starting the engine")
    engine = create_engine(config)
    dtype = engine.core.dtype
    try:
        run_engine(engine, requests[:2])  # warm-up
        progress("timing the engine")
        engine_s = run_engine(engine, requests)
    finally:
        engine.shutdown()
    progress(f"engine: {engine_s:.1f}s; loading Hugging Face ({dtype})")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(engine.core.device).eval()
    run_hf(model, tokenizer, requests[:2], args.hf_batch_size)
    progress(f"timing Hugging Face generate in static batches of {args.hf_batch_size}")
    hf_s = run_hf(model, tokenizer, requests, args.hf_batch_size)
    result = {"requests": len(requests), "output_tokens": total_tokens, "dtype": str(dtype).replace("torch.", ""),
              "device": str(engine.core.device), "threads": torch.get_num_threads(),
              "engine_s": round(engine_s, 3), "hf_s": round(hf_s, 3),
              "engine_tok_s": round(total_tokens / engine_s, 2), "hf_tok_s": round(total_tokens / hf_s, 2),
              "hf_batch_size": args.hf_batch_size}
    result["ratio"] = round(result["engine_tok_s"] / result["hf_tok_s"], 3)
    report(result, args.json, f"embedded engine: {result['engine_tok_s']} tok/s   HF generate: "
                              f"{result['hf_tok_s']} tok/s   ratio {result['ratio']}x")
    return 0
