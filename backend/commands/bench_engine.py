"""`tritonllm bench engine`: the embedded engine against Hugging Face `generate` on the same requests, in one run.

Both sides decode greedily and ignore the end token, so every request produces exactly its requested number of
tokens; throughput counts those requested tokens over wall time (prefill included). Hugging Face runs the requests
as static batches (left-padded, each batch runs until its longest request is done); the engine gets them all at once.

Workloads: `default` cuts prompts from the text the package ships; `nano` is nano-vllm's benchmark (256 requests,
prompts of random token ids, prompt and output lengths uniform in [100, 1024]). With `--load-format dummy` both
sides run random weights built from config.json alone (a `tritonllm model shape` folder needs nothing else), so the
benchmark reruns on any GPU without downloading weights. `--profile` runs the engine's workload once more under
torch.profiler and reports where the device time went."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import resource
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from tritonllm.commands.bench_profile import profile_engine
from tritonllm.commands.bench_report import progress, report
from tritonllm.engine.types import SamplingParams

MIX_FLAGS = ("requests", "min_prompt", "max_prompt", "min_output", "max_output")
DEFAULT_MIX = dict(requests=16, min_prompt=16, max_prompt=256, min_output=16, max_output=128)
NANO_MIX = dict(requests=256, min_prompt=100, max_prompt=1024, min_output=100, max_output=1024)
# Without these the engine's defaults (a batch of 64) would cap nano's 256 requests submitted at once.
NANO_ENGINE_DEFAULTS = dict(max_batch_size=256, max_seq_len=4096)
NANO_TOKEN_ID_LIMIT = 10000  # nano-vllm draws prompt ids below this
WARMUP_REQUESTS = 2  # the engine's warm-up without --warmup
HF_DUMMY_SEED = 0


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    engine_defaults: dict = field(default_factory=dict)  # engine settings used where neither flag nor config sets one


# ---- workloads ----


def make_requests(
    tokenizer, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """Prompts cut from the text the package ships, lengths drawn uniformly from the ranges."""
    text = resources.files("tritonllm.checkpoints").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")
    corpus = tokenizer.encode(text, add_special_tokens=False)
    while len(corpus) < prompt_range[1] * 2:
        corpus = corpus + corpus
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - length)
        requests.append(BenchRequest(corpus[start : start + length], rng.randint(*output_range)))
    return requests


def make_nano_requests(
    vocab_size: int,
    seed: int = 0,
    count: int = NANO_MIX["requests"],
    prompt_range: tuple[int, int] = (NANO_MIX["min_prompt"], NANO_MIX["max_prompt"]),
    output_range: tuple[int, int] = (NANO_MIX["min_output"], NANO_MIX["max_output"]),
) -> list[BenchRequest]:
    """nano-vllm's mix: prompts of random ids below min(10000, vocab), lengths uniform in the ranges (inclusive);
    all prompts are drawn first, then all output lengths, as nano-vllm does."""
    rng = random.Random(seed)
    id_limit = min(NANO_TOKEN_ID_LIMIT, vocab_size)
    prompts = [[rng.randrange(id_limit) for _ in range(rng.randint(*prompt_range))] for _ in range(count)]
    return [BenchRequest(prompt, rng.randint(*output_range)) for prompt in prompts]


def resolve_workload(args) -> Workload:
    """The workload the flags ask for; a ConfigError naming the flag for a length range that is empty, or for a
    request-mix flag given with --workload nano (whose mix is fixed)."""
    from tritonllm.engine.config import ConfigError

    if args.workload == "nano":
        given = [flag for flag in MIX_FLAGS if getattr(args, flag) is not None]
        if given:
            raise ConfigError(
                f"--workload nano fixes the request mix (256 requests, prompt and output lengths "
                f"100-1024): leave out {', '.join(_flag(name) for name in given)}"
            )
        mix, defaults = NANO_MIX, NANO_ENGINE_DEFAULTS
    else:
        mix = {name: DEFAULT_MIX[name] if getattr(args, name) is None else getattr(args, name) for name in MIX_FLAGS}
        defaults = {}
    for name in ("prompt", "output"):  # each is >= 1 already (arg_types.count)
        low, high = mix[f"min_{name}"], mix[f"max_{name}"]
        if low > high:
            raise ConfigError(f"--min-{name} {low} / --max-{name} {high}: need min <= max")
    return Workload(
        args.workload,
        mix["requests"],
        (mix["min_prompt"], mix["max_prompt"]),
        (mix["min_output"], mix["max_output"]),
        dict(defaults),
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_settings(args, workload: Workload) -> dict[str, Any]:
    """model.yaml (read once) < the workload's defaults where it sets nothing < the command's flags, as the
    engine's arguments (which follower ranks are started with too)."""
    from tritonllm.engine.config import load_yaml_args

    yaml_args = load_yaml_args(args.config) if args.config else {}
    yaml_args.pop("model", None)  # --model names the folder
    defaults = {key: value for key, value in workload.engine_defaults.items() if yaml_args.get(key) is None}
    flags = dict(
        dtype=args.dtype,
        device=args.device,
        max_batch_size=args.max_batch_size,
        load_format=args.load_format,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", None),
    )
    given = {key: value for key, value in flags.items() if value is not None}
    return {"engine": "embedded", **defaults, **yaml_args, **given, "model": args.model}


def engine_config(args, workload: Workload):
    from tritonllm.engine.config import EngineConfig

    return EngineConfig.from_dict(engine_settings(args, workload))


def workload_requests(workload: Workload, config, tokenizer, seed: int) -> list[BenchRequest]:
    if workload.name == "nano":
        from tritonllm.engine.embedded.loader import read_model_config

        return make_nano_requests(read_model_config(config.model).vocab_size, seed)
    return make_requests(tokenizer, workload.requests, workload.prompt_range, workload.output_range, seed)


# ---- the engine side ----


def run_engine(engine, requests: list[BenchRequest]) -> float:
    start = time.perf_counter()
    handles = [
        engine.generate_async(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True)) for r in requests
    ]
    for handle, request in zip(handles, requests):
        produced = len(handle.result().outputs[0].token_ids)
        if produced != request.output_len:
            raise RuntimeError(f"engine produced {produced} tokens, expected {request.output_len}")
    return time.perf_counter() - start


def engine_facts(engine, config) -> dict[str, Any]:
    """What the engine ran with, for the result: the settings that move its speed."""
    import torch

    core = engine.core
    return {
        "dtype": str(core.dtype).replace("torch.", ""),
        "device": str(core.device),
        "threads": torch.get_num_threads(),
        "attn_backend": _attn_backend(config, core.device),
        "cuda_graphs": getattr(core.runner, "graphs", None) is not None,
        "max_batch_size": config.max_batch_size,
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "max_seq_len": core.max_seq_len,
        "disable_overlap_scheduler": config.disable_overlap_scheduler,
    }


def _attn_backend(config, device) -> str:
    """The backend that runs (TRTLLM, the default, picks one per device); as configured where it cannot be told."""
    try:
        from tritonllm.engine.embedded.attention import resolve_backend
    except ImportError:
        return config.attn_backend
    return resolve_backend(config.attn_backend, device)


def shifted(requests: list[BenchRequest], vocab_size: int) -> list[BenchRequest]:
    """The same lengths with every prompt id moved by one: a warm-up whose prompts leave the timed run no cached
    prefix to reuse (it would skip prefill work Hugging Face does)."""
    return [BenchRequest([(t + 1) % vocab_size for t in r.prompt_ids], r.output_len) for r in requests]


def bench_engine(config, requests: list[BenchRequest], args) -> dict[str, Any]:
    """Warm-up, the timed run and, with --profile, a profiled run; the engine's part of the result."""
    from tritonllm.engine import create_engine
    from tritonllm.engine.embedded.parallel.environment import read_rank_environment
    from tritonllm.engine.embedded.parallel.group import leave_group

    started = time.perf_counter()
    with contextlib.ExitStack() as ranks:  # left in reverse: engine, group, then the follower processes
        if config.world_size > 1:
            if read_rank_environment(os.environ) is None:
                ranks.enter_context(bench_ranks(args, config))
            ranks.callback(leave_group, wait_for_others=False)
        engine = create_engine(config)
        ranks.callback(engine.shutdown)  # it stops the followers
        return _timed_runs(engine, config, requests, args, started)


def bench_ranks(args, config):
    """The other ranks of a parallel engine, on this host, logging into a new temporary folder."""
    from tritonllm.deploy.followers import local_ranks

    log_dir = Path(tempfile.mkdtemp(prefix="tritonllm-ranks-"))
    progress(f"parallel engine: this process is rank 0 of {config.world_size}; the others log to {log_dir}")
    return local_ranks(engine_settings(args, resolve_workload(args)), config.world_size, log_dir)


def _timed_runs(engine, config, requests: list[BenchRequest], args, started: float) -> dict[str, Any]:
    from tritonllm.engine.embedded.engine import EmbeddedEngine

    assert isinstance(engine, EmbeddedEngine)  # what this bench measures (engine_facts reads its core)
    facts = engine_facts(engine, config)
    device = engine.core.device
    progress(
        f"engine ready in {time.perf_counter() - started:.1f}s ({facts['device']}, {facts['dtype']}, "
        f"attention {facts['attn_backend']}, CUDA graphs {'on' if facts['cuda_graphs'] else 'off'})"
    )
    warmup = shifted(requests if args.warmup else requests[:WARMUP_REQUESTS], engine.core.model_config.vocab_size)
    progress(f"engine warm-up: {len(warmup)} requests")
    run_engine(engine, warmup)
    reset_peak_memory(device)
    steps_before = engine.wait_idle().num_steps
    phase_before = dict(engine.core.step_seconds)
    wait_before = engine.core.token_wait_seconds
    progress("timing the engine")
    with collector_pauses() as pauses:
        seconds = run_engine(engine, requests)
    result = {
        **facts,
        "engine_s": round(seconds, 3),
        "engine_steps": engine.wait_idle().num_steps - steps_before,
        # Wall seconds of the engine's steps by phase; engine_s less their sum is time outside steps.
        "engine_phase_s": {
            phase: round(total - phase_before[phase], 4) for phase, total in engine.core.step_seconds.items()
        },
        # Of the steps' time, the engine thread waiting for the GPU's tokens: the rest is host work.
        "engine_token_wait_s": round(engine.core.token_wait_seconds - wait_before, 4),
        "gc_pause_s": round(pauses["seconds"], 4),  # Python's garbage collector, any thread
        "gc_collections": pauses["collections"],
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    outside = seconds - sum(result["engine_phase_s"].values())
    progress(
        "engine steps: "
        + ", ".join(f"{p} {s:.3f}s" for p, s in result["engine_phase_s"].items())
        + f", outside steps {outside:.3f}s; waiting for tokens {result['engine_token_wait_s']:.3f}s; "
        + f"{pauses['collections']} garbage collections, {pauses['seconds']:.3f}s"
    )
    if args.profile or args.profile_trace:
        # Prompts shifted once more: the timed run's prompts would come back from the prefix cache.
        vocab = engine.core.model_config.vocab_size
        profiled = shifted(shifted(requests, vocab), vocab)
        result.update(profile_engine(lambda: run_engine(engine, profiled), device, args.profile_trace))
    return result


@contextmanager
def collector_pauses() -> Iterator[dict[str, Any]]:
    """Counts the garbage collector's runs and the seconds they took while the block runs (gc.callbacks)."""
    pauses: dict[str, Any] = {"seconds": 0.0, "collections": 0}
    started: list[float] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses["seconds"] += time.perf_counter() - started.pop()
            pauses["collections"] += 1

    gc.callbacks.append(note)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(note)


# ---- memory ----


def reset_peak_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device) -> int:
    """CUDA: the allocator's peak since the last reset. CPU: the process's peak resident set (no reset exists)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB


def release_device_memory(device) -> None:
    """Give the engine's weights and KV cache back before Hugging Face loads (an 8B model twice may not fit)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the Hugging Face side ----


def load_hf_model(model_dir: str, load_format: str, dtype, device):
    """The folder's weights, or (dummy) transformers' own random initialisation built on the device itself."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        torch.manual_seed(HF_DUMMY_SEED)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run_hf(model, tokenizer, requests: list[BenchRequest], batch_size: int) -> float:
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = model.device
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        # Inputs on the model's device: from the CPU, transformers warns and every step pays a copy.
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch], device=device)
        new_tokens = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_hf(args, load_format: str, requests: list[BenchRequest], tokenizer, dtype, device) -> dict[str, Any]:
    """Warm-up (the whole workload with --warmup, else one full batch: the size it is timed at), then the timed
    pass; Hugging Face's part of the result."""
    progress(f"loading Hugging Face ({str(dtype).replace('torch.', '')}, {load_format} weights)")
    model = load_hf_model(args.model, load_format, dtype, device)
    warmup = requests if args.warmup else requests[: args.hf_batch_size]
    progress(f"Hugging Face warm-up: {len(warmup)} requests")
    run_hf(model, tokenizer, warmup, args.hf_batch_size)
    reset_peak_memory(device)
    progress(f"timing Hugging Face generate in static batches of {args.hf_batch_size}")
    seconds = run_hf(model, tokenizer, requests, args.hf_batch_size)
    result = {"hf_s": round(seconds, 3), "hf_batch_size": args.hf_batch_size}
    if device.type == "cuda":
        result["hf_peak_memory_bytes"] = peak_memory_bytes(device)
    return result


# ---- the command ----


def main(args) -> int:
    import torch
    from transformers import AutoTokenizer

    workload = resolve_workload(args)
    config = engine_config(args, workload)
    needs_tokenizer = workload.name == "default" or args.baseline == "hf"
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or args.model) if needs_tokenizer else None
    requests = workload_requests(workload, config, tokenizer, args.seed)
    total_tokens = sum(r.output_len for r in requests)
    progress(
        f"{workload.name} workload: {len(requests)} requests, {sum(len(r.prompt_ids) for r in requests)} "
        f"prompt and {total_tokens} output tokens; starting the engine ({config.load_format} weights)"
    )
    result = {
        "requests": len(requests),
        "output_tokens": total_tokens,
        "workload": workload.name,
        "load_format": config.load_format,
        "warmup": args.warmup,
        "baseline": args.baseline,
        **bench_engine(config, requests, args),
    }
    result["engine_tok_s"] = round(total_tokens / result["engine_s"], 2)
    summary = f"embedded engine: {result['engine_tok_s']} tok/s"
    if args.baseline == "hf":
        device = torch.device(result["device"])
        release_device_memory(device)
        result.update(bench_hf(args, config.load_format, requests, tokenizer, getattr(torch, result["dtype"]), device))
        result["hf_tok_s"] = round(total_tokens / result["hf_s"], 2)
        result["ratio"] = round(result["engine_tok_s"] / result["hf_tok_s"], 3)
        summary += f"   HF generate: {result['hf_tok_s']} tok/s   ratio {result['ratio']}x"
    report(result, args.json, summary)
    return 0
